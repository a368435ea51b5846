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
