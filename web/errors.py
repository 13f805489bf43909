"""The dashboard's domain errors: what a run operation refuses, with the HTTP status to answer it with
(app.py turns each into a JSON {"detail": ...} response, in one exception handler)."""


class RunError(Exception):
    status = 400

    def __init__(self, detail):
        super().__init__(detail)
        self.detail = detail


class NotFound(RunError):
    status = 404

    def __init__(self, detail="no such run"):
        super().__init__(detail)


class Conflict(RunError):
    status = 409


class TooManyRequests(RunError):
    status = 429


class Invalid(RunError):
    """A request value the dashboard refuses beyond its schema: a 422 shaped like a validation error's,
    {"detail": [{"loc": ["body", field...], "msg", "type"}]}."""
    status = 422

    def __init__(self, msg, *loc):
        super().__init__([{"loc": ["body", *loc], "msg": msg, "type": "value_error"}])
        self.msg = f"{loc[-1]}: {msg}" if loc else msg

    def __str__(self):
        return self.msg
