"""The one error type for user mistakes; the CLI turns it into one line on stderr and exit code 2."""


class KvsimError(Exception):
    """A mistake in the user's input (file, field, flag), with a message that names where it is.

    Internal invariants use `assert`; anything a user can cause raises this.
    """

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        where = ": ".join(p for p in (source, field) if p)
        super().__init__(f"{where}: {message}" if where else message)
        self.source = source
        self.field = field
