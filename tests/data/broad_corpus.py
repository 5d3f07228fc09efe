"""A broad generated corpus for the filters' agreement with datatrove: text of any kind, seeded, in memory.

`broad_corpus(n, seed)` returns ``(category, text)`` pairs: package READMEs, benchmark passages, prose in many
languages, planted web junk, symbol runs, emoji, code and code-like Markdown, tables, URLs and addresses,
CJK, right-to-left scripts, very long lines, mixed scripts and quoted text, each mixed with English prose of
varied length so that every rule's threshold is crossed both ways. Nothing is read from disk but the
sample's web shards (tests/data/filter_corpora.py), whose lines serve as the English prose.
"""
from __future__ import annotations

import functools
import random

from filter_corpora import PROSE, sample_web

LANGS = {
    "fr": ["Le chat dort sur le canapé depuis ce matin.", "Nous avons visité le musée avant la pluie.",
           "La réunion a été reportée à jeudi prochain, à cause des grèves.", "« C'est incroyable ! » a-t-elle dit."],
    "de": ["Die Katze schläft seit heute Morgen auf dem Sofa.", "Wir haben das Museum vor dem Regen besucht.",
           "Die Sitzung wurde auf nächsten Donnerstag verschoben, z. B. wegen des Streiks.",
           "„Das ist unglaublich!“, sagte sie."],
    "es": ["El gato duerme en el sofá desde esta mañana.", "¿Dónde está la estación de tren?",
           "¡Qué sorpresa tan agradable!", "La reunión se aplazó al jueves, según el Sr. García."],
    "it": ["Il gatto dorme sul divano da stamattina.", "Abbiamo visitato il museo prima della pioggia.",
           "La riunione è stata rinviata a giovedì prossimo."],
    "pt": ["O gato dorme no sofá desde esta manhã.", "Visitamos o museu antes da chuva.",
           "A reunião foi adiada para quinta-feira, segundo o Dr. Silva."],
    "nl": ["De kat slaapt sinds vanochtend op de bank.", "We hebben het museum voor de regen bezocht."],
    "pl": ["Kot śpi na kanapie od rana.", "Zwiedziliśmy muzeum przed deszczem.", "Spotkanie przełożono na czwartek."],
    "tr": ["Kedi sabahtan beri kanepede uyuyor.", "Yağmurdan önce müzeyi ziyaret ettik."],
    "ru": ["Кошка спит на диване с самого утра.", "Мы посетили музей до дождя.",
           "Встреча перенесена на следующий четверг, т. е. на 5-е число.", "«Это невероятно!» — сказала она."],
    "uk": ["Кіт спить на дивані з самого ранку.", "Ми відвідали музей перед дощем."],
    "el": ["Η γάτα κοιμάται στον καναπέ από το πρωί.", "Επισκεφτήκαμε το μουσείο πριν από τη βροχή;"],
    "hi": ["बिल्ली सुबह से सोफ़े पर सो रही है।", "हमने बारिश से पहले संग्रहालय देखा।", "बैठक अगले गुरुवार तक टाल दी गई॥"],
    "bn": ["বিড়ালটি সকাল থেকে সোফায় ঘুমাচ্ছে।", "আমরা বৃষ্টির আগে জাদুঘর দেখেছি।"],
    "th": ["แมวนอนบนโซฟาตั้งแต่เช้า", "เราไปพิพิธภัณฑ์ก่อนฝนตก"],
    "vi": ["Con mèo ngủ trên ghế sofa từ sáng.", "Chúng tôi đã thăm bảo tàng trước khi trời mưa."],
    "id": ["Kucing itu tidur di sofa sejak pagi.", "Kami mengunjungi museum sebelum hujan."],
    "sw": ["Paka amelala kwenye kochi tangu asubuhi.", "Tulitembelea makumbusho kabla ya mvua."],
    "fi": ["Kissa on nukkunut sohvalla aamusta asti.", "Kävimme museossa ennen sadetta."],
    "hy": ["Կատուն առավոտից քնած է բազմոցին։", "Մենք անձրևից առաջ այցելեցինք թանգարան։"],
    "am": ["ድመቷ ከጠዋት ጀምሮ በሶፋው ላይ ተኝታለች።", "ከዝናቡ በፊት ሙዚየሙን ጎበኘን።"],
}
CJK = {
    "zh": ["猫从早上开始就在沙发上睡觉。", "我们在下雨之前参观了博物馆！", "会议推迟到下周四，因为罢工。",
           "他说：“这太不可思议了！”", "中文句子。还有，这个！"],
    "ja": ["猫は朝からソファで寝ている。", "雨が降る前に博物館を訪れました！", "会議は来週の木曜日に延期されました。",
           "「信じられない！」と彼女は言った。"],
    "ko": ["고양이는 아침부터 소파에서 자고 있다.", "우리는 비가 오기 전에 박물관을 방문했다!",
           "회의는 다음 주 목요일로 연기되었다."],
}
RTL = {
    "ar": ["القطة نائمة على الأريكة منذ الصباح.", "زرنا المتحف قبل المطر؟",
           "تم تأجيل الاجتماع إلى يوم الخميس المقبل؛ بسبب الإضراب.", "قال: «هذا أمر لا يصدق!»"],
    "he": ["החתול ישן על הספה מאז הבוקר.", "ביקרנו במוזיאון לפני הגשם?", "הפגישה נדחתה ליום חמישי הבא."],
    "fa": ["گربه از صبح روی مبل خوابیده است.", "ما قبل از باران از موزه دیدن کردیم؟"],
    "ur": ["بلی صبح سے صوفے پر سو رہی ہے۔", "ہم نے بارش سے پہلے عجائب گھر دیکھا۔"],
}
EMOJI = ["😀", "🔥", "👍", "🎉", "❤️", "🇺🇸", "👨‍👩‍👧", "✨", "🚀", "😂😂😂", "💯", "🙏🏽", "☕", "✅", "⭐⭐⭐⭐⭐"]
SYMBOL_RUNS = ["$$$", "!!!", "???", "***", "~~~", "=====", "-----", "....", "!!!!!!", "#####", "$$$$$", ">>>", "<<<",
               "+++", "&&&", "%%%", "@@@", "|||", "___", "^^^", "?!?!", "!?", "$1,000,000!!!", "100%!!!", "(((", ")))",
               "…", "……", "•••", "→→→", "★★★", "♥♥♥", "---->", "<!--", "-->", "::", ";;", ",,,", "''", '""']
JUNK = ["Home | About | Contact | Blog", "Copyright © 2023 All rights reserved.", "Skip to main content",
        "This website uses cookies to improve your experience.", "Please enable JavaScript to view this page.",
        "Lorem ipsum dolor sit amet, consectetur adipiscing elit.", "Click here to subscribe!",
        "Share on Facebook Twitter Pinterest", "Posted by admin on March 3, 2021", "Read more »", "Log in | Register",
        "Our privacy policy and terms of use apply.", "Tags: news, sports, weather, tips", "« Previous Next »",
        "Sign up for our newsletter", "Accept all cookies", "Search for:", "Menu", "Related posts:", "1 2 3 4 5 Next",
        "Buy now cheap viagra casino bonus free spins", "Loading...", "Advertisement", "[edit]", "Cite this page [1]"]
CODE = [
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "for (let i = 0; i < n; i++) {\n  console.log(i);\n}",
    "#include <stdio.h>\nint main(void) {\n    printf(\"hello\\n\");\n    return 0;\n}",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "$ pip install -U tokenfarm==0.1.0\n$ export PATH=$HOME/.local/bin:$PATH",
    '{"name": "demo", "version": "1.2.3", "dependencies": {"numpy": ">=1.26"}}',
    "<div class=\"nav\"><a href=\"/home\">Home</a> | <a href=\"/about\">About</a></div>",
    ".button { color: #fff; background: #333; padding: 4px 8px; }",
    "if x == None:\n    raise ValueError('x must be set')  # TODO: fix\nelse:\n    y = x ** 2 // 3",
    "fn main() {\n    let v: Vec<i32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}",
    "x = [i for i in range(10) if i % 2 == 0]; d = {k: v for k, v in zip(a, b)}",
    "git clone https://github.com/user/repo.git && cd repo && make test",
    "/* [clinic input]\nos.stat\n    path : path_t\n[clinic start generated code]*/",
    ">>> import math\n>>> math.sqrt(16)\n4.0",
]
NAMES = ["fastparse", "tinydb-lite", "pyquant", "nanoserve", "datatool", "yaml2json", "webcrawl", "mini-orm"]
QUESTIONS = [
    ("What is the boiling point of water at sea level?", ["90 °C", "100 °C", "110 °C", "120 °C"]),
    ("Which planet is known as the Red Planet?", ["Venus", "Mars", "Jupiter", "Saturn"]),
    ("Who wrote 'Pride and Prejudice'?", ["Jane Austen", "Charles Dickens", "Mark Twain", "Emily Brontë"]),
    ("What is 15% of 200?", ["15", "20", "30", "45"]),
]
WORDS = ("the of and to in that have with be it for not on as you do at this but his by from they we say her she "
         "or an will my one all would there their what so up out if about who get which go me when make can like "
         "time no just him know take people into year your good some could them see other than then now look only "
         "come its over think also back after use two how our work first well way even new want because any these "
         "give day most us river mountain history science language market data model training pipeline").split()


@functools.cache
def _english_lines() -> tuple[str, ...]:
    """English prose lines: the sample's web documents' lines of 8+ words, and PROSE."""
    lines = [ln.strip() for doc in sample_web()[:400] for ln in doc.split("\n") if len(ln.split()) >= 8]
    return tuple(PROSE) + tuple(lines[:6000])


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 16))).capitalize() + rng.choice(".....?!;:")


def _prose(rng: random.Random, k: int) -> list[str]:
    lines = _english_lines()
    return [rng.choice(lines) if rng.random() < 0.7 else _sentence(rng) for _ in range(k)]


def _foreign(rng: random.Random, bank: dict, k: int) -> list[str]:
    lang = rng.choice(sorted(bank))
    return [" ".join(rng.choice(bank[lang]) for _ in range(rng.randint(1, 4))) for _ in range(k)]


def _readme(rng: random.Random) -> list[str]:
    name = rng.choice(NAMES)
    out = [f"# {name}", "",
           f"[![PyPI](https://img.shields.io/pypi/v/{name}.svg)](https://pypi.org/project/{name}/) "
           f"[![CI](https://github.com/acme/{name}/actions/workflows/ci.yml/badge.svg)](https://github.com/acme/{name})",
           "", rng.choice(_english_lines()), "", "## Installation", "", "```bash", f"pip install {name}", "```", "",
           "## Usage", "", "```python", rng.choice(CODE), "```", "", "## Features", ""]
    out += [f"- {rng.choice(['Fast', 'Simple', 'Typed', 'Tested'])}: {_sentence(rng)}"
            for _ in range(rng.randint(2, 6))]
    out += ["", "| option | default | description |", "|---|---|---|"]
    out += [f"| `--{w}` | `{rng.randint(0, 99)}` | {_sentence(rng)} |" for w in rng.sample(WORDS, 3)]
    out += ["", "## License", "", f"MIT © 2024 {rng.choice(['Ada', 'Linus', 'Grace'])}"]
    return out + (_prose(rng, rng.randint(0, 8)) if rng.random() < 0.5 else [])


def _benchmark(rng: random.Random) -> list[str]:
    q, choices = rng.choice(QUESTIONS)
    passage = _prose(rng, rng.randint(2, 10))
    kind = rng.randrange(3)
    if kind == 0:
        return passage + ["", f"Question: {q}"] + [f"{'ABCD'[i]}. {c}" for i, c in enumerate(choices)] + ["Answer:"]
    if kind == 1:
        a, b = rng.randint(2, 90), rng.randint(2, 90)
        return passage + [f"Natalia sold clips to {a} of her friends in April, and then she sold {b} clips in May. "
                          "How many clips did Natalia sell altogether in April and May?",
                          f"Natalia sold {a}+{b} = <<{a}+{b}={a + b}>>{a + b} clips.", f"#### {a + b}"]
    return [" ".join(passage), "", f"Q: {q} A: {rng.choice(choices)}", f"Q: {q} A:"]


def _with(rng: random.Random, items: list[str], lines: list[str], rate: float) -> list[str]:
    """Words of ``items`` inserted into ``lines`` (about ``rate`` per word)."""
    out = []
    for line in lines:
        ws = line.split(" ")
        out.append(" ".join(w + (" " + rng.choice(items) if rng.random() < rate else "") for w in ws))
    return out


def _doc(rng: random.Random, cat: str) -> list[str]:
    k = rng.choice([2, 4, 6, 10, 16, 30])
    if cat == "readme":
        return _readme(rng)
    if cat == "benchmark":
        return _benchmark(rng)
    if cat == "languages":
        return _foreign(rng, LANGS, k) + (_prose(rng, rng.randint(0, 4)) if rng.random() < 0.4 else [])
    if cat == "junk":
        lines = _prose(rng, k)
        for _ in range(rng.randint(1, 12)):
            lines.insert(rng.randrange(len(lines) + 1), rng.choice(JUNK))
        if rng.random() < 0.3:
            lines += [rng.choice(lines)] * rng.randint(1, 6)
        return lines
    if cat == "symbols":
        lines = _with(rng, SYMBOL_RUNS, _prose(rng, k), rng.choice([0.02, 0.05, 0.1, 0.2, 0.4]))
        if rng.random() < 0.5:
            lines.append(" ".join(rng.choice(SYMBOL_RUNS + ["CHEAP", "FREE", "WIN", "NOW"]) for _ in range(30)))
        return lines
    if cat == "emoji":
        return _with(rng, EMOJI, _prose(rng, k), rng.choice([0.02, 0.1, 0.3, 0.8]))
    if cat == "code":
        lines = _prose(rng, rng.randint(0, 6))
        for _ in range(rng.randint(1, 5)):
            block = rng.choice(CODE).split("\n")
            lines += (["```python"] + block + ["```"]) if rng.random() < 0.5 else block
            lines += _prose(rng, rng.randint(0, 3))
        return lines
    if cat == "table":
        cols = rng.randint(2, 6)
        rows = [" | ".join(rng.choice(WORDS + [str(rng.randint(0, 9999))]) for _ in range(cols)) for _ in range(k)]
        if rng.random() < 0.5:
            rows = [f"| {r} |" for r in rows]
            rows.insert(1, "|" + "---|" * cols)
        else:
            rows = ["+" + "-----+" * cols] + rows + ["+" + "-----+" * cols]
        return _prose(rng, rng.randint(0, 8)) + rows + _prose(rng, rng.randint(0, 4))
    if cat == "urls":
        items = ["https://example.com/path?q=1&x=y", "www.acme.org", "http://192.168.0.1:8080/admin",
                 f"{rng.choice(WORDS)}.{rng.choice(WORDS)}@example.com", f"{rng.randint(1, 223)}.{rng.randint(0, 255)}."
                 f"{rng.randint(0, 255)}.{rng.randint(0, 255)}", "10.0.0.1", "mailto:info@acme.co.uk",
                 "ftp://files.acme.org/pub/", "/usr/local/bin/python3", "C:\\Users\\me\\file.txt", "8.8.8.8",
                 "[1]", "[citation needed]", "user@[192.168.1.1]"]
        return _with(rng, items, _prose(rng, k), rng.choice([0.02, 0.1, 0.3]))
    if cat == "cjk":
        return _foreign(rng, CJK, k) + (_prose(rng, rng.randint(0, 3)) if rng.random() < 0.3 else [])
    if cat == "rtl":
        return _foreign(rng, RTL, k) + (_prose(rng, rng.randint(0, 3)) if rng.random() < 0.3 else [])
    if cat == "long_lines":
        lines = _prose(rng, rng.randint(0, 4)) + [" ".join(_prose(rng, rng.randint(20, 200)))]
        if rng.random() < 0.4:
            lines.append("data:image/png;base64," + "".join(rng.choice("ABCDEFabcdef0123456789+/") for _ in
                                                            range(rng.choice([500, 1200, 3000]))) + ".")
        return lines
    if cat == "mixed":
        banks = [LANGS[c] for c in sorted(LANGS)] + [CJK[c] for c in sorted(CJK)] + [RTL[c] for c in sorted(RTL)]
        out = []
        for line in _prose(rng, k):
            ws = line.split(" ")
            i = rng.randrange(len(ws))
            other = rng.choice(rng.choice(banks)).split(" ")
            out.append(" ".join(ws[:i] + other[:rng.randint(1, 4)] + ws[i:]))
        return out
    if cat == "quoted":
        out = []
        for line in _prose(rng, k):
            form = rng.randrange(6)
            out.append([f"“{line}” she said.", f'"{line}," he replied. "Really?"', f"> {line}", f"'{line}'",
                        f"«{line}»", f"He wrote: „{line}“ — and left."][form])
        return out
    raise ValueError(cat)


CATEGORIES = ("readme", "benchmark", "languages", "junk", "symbols", "emoji", "code", "table", "urls", "cjk", "rtl",
              "long_lines", "mixed", "quoted")


def broad_corpus(n: int = 2800, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` documents, ``(category, text)``, the categories in turn; line and paragraph breaks vary."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        cat = CATEGORIES[i % len(CATEGORIES)]
        lines = _doc(rng, cat)
        sep = rng.choice(["\n", "\n", "\n", "\n\n", " "])
        docs.append((cat, sep.join(lines)))
    return docs
