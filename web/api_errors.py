"""The dashboard's API errors: what a request is refused for, with the HTTP status to answer it with
(app.py turns each into a JSON {"detail": ...} response, in one exception handler)."""


class ApiError(Exception):
    status = 400

    def __init__(self, detail):
        super().__init__(detail)
        self.detail = detail


class NotFound(ApiError):
    status = 404

    def __init__(self, detail="no such run"):
        super().__init__(detail)


class Conflict(ApiError):
    status = 409


class TooManyRequests(ApiError):
    status = 429


class Invalid(ApiError):
    """A request value the dashboard refuses beyond its schema: a 422 shaped like a validation error's,
    {"detail": [{"loc": ["body", field...], "msg", "type"}]}."""
    status = 422

    def __init__(self, msg, *loc):
        super().__init__([{"loc": ["body", *loc], "msg": msg, "type": "value_error"}])
        self.msg = f"{loc[-1]}: {msg}" if loc else msg

    def __str__(self):
        return self.msg
