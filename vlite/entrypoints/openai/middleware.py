"""ASGI middleware under the server's routes: the request-body limit (413) and the count of admitted
generation requests (the overload guard's), with the JSON response of an OpenAIError they answer with."""

from __future__ import annotations

from typing import Any, Callable, Optional

from fastapi.responses import JSONResponse

from vlite.entrypoints.openai.serving_engine import OpenAIError


def error_response(e: OpenAIError, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """An OpenAIError as an HTTP response (503s say when to retry)."""
    if e.status == 503:
        headers = {"Retry-After": "1", **(headers or {})}
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class BodyLimit:
    """ASGI middleware: read the whole request body up front and answer 413 past `limit` bytes.

    Checks the Content-Length header first, then counts the bytes actually received, so a chunked
    upload without a Content-Length cannot get past the limit either. The app then gets the body in
    one message; later receive() calls (disconnect detection) go to the client as before.
    """

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.limit:
            await self._too_large(scope, send, f"request body is {length} bytes, more than the limit of "
                                                f"{self.limit} bytes")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._too_large(scope, send, f"request body is more than the limit of {self.limit} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _too_large(scope: dict, send: Callable, message: str) -> None:
        # Connection: close, since the rest of the body is left unread.
        await error_response(OpenAIError(message, 413), {"Connection": "close"})(scope, _no_receive, send)


async def _no_receive() -> dict:
    return {"type": "http.disconnect"}


class AdmissionCount:
    """Generation requests admitted and not yet answered in full (streams included)."""

    _KEY = "vlite.admitted"

    def __init__(self) -> None:
        self.pending = 0

    def admit(self, scope: dict) -> None:
        slot = scope.get(self._KEY)
        if slot is not None and not slot[0]:
            slot[0] = True
            self.pending += 1

    class Middleware:
        """Releases a request's count when the app is done with it: answered, failed or disconnected."""

        def __init__(self, app: Any, counter: AdmissionCount) -> None:
            self.app, self.counter = app, counter

        async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
            if scope["type"] != "http":
                await self.app(scope, receive, send)
                return
            slot = scope[AdmissionCount._KEY] = [False]  # a list: shared even if the scope is copied
            try:
                await self.app(scope, receive, send)
            finally:
                if slot[0]:
                    self.counter.pending -= 1
