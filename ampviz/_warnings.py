"""ampviz's own warning class, so tests (and users) can filter or escalate it."""


class AmpvizWarning(UserWarning):
    """Something ampviz did is approximate or was adjusted; the message says what."""
