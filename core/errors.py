"""The two errors a user fixes by changing the input: never retried, always worded as what to do."""


class ConfigError(ValueError):
    """A configuration problem, worded for the user: which field, what is wrong, what to do."""


class DataError(ValueError):
    """The input data cannot be used as given; the message says what to change."""
