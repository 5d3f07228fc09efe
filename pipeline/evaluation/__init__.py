"""Evaluation: the evaluate stage, the Hugging Face export, benchmark scorers."""
