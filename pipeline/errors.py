"""The exceptions a user sees: one message that names the file or config key and the fix.

A leaf module (no imports from the package), so every layer can raise these. `pipeline.io.run_cli`
turns any of them into one `error:` line and exit status 1.
"""


class PipelineError(RuntimeError):
    """A user-facing failure: the message names the file or config key and the fix."""


class ConfigError(PipelineError):
    """One clear configuration error, naming the key and the fix."""


class PlanError(PipelineError):
    """The plan is infeasible or its inputs are wrong; the message names the key or file to change."""
