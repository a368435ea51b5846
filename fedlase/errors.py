"""User-facing errors: the CLI prints them as one line and exits with status 2."""


class UserError(Exception):
    """A problem with the user's input (config, data files); never a bug in fedlase."""


class ConfigError(UserError):
    """A bad config value. The message names the key and what is allowed."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


class DataError(UserError):
    """Missing or corrupt data files."""


class RunExists(UserError):
    """`out` already holds a run (a checkpoint or a summary) that the caller did not ask to continue. The message
    says how to continue it in the caller's own words: `fedlase run --resume`, or `fedlase.run(cfg, resume=True)`."""

    def __init__(self, out, resume_hint: str = "pass --resume"):
        self.out = out
        super().__init__(f"out: {out} already holds a run; {resume_hint} to continue it or choose another out")
