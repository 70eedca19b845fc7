"""ASGI layers wrapped around the daemon's routes: the admin API's gate (credentials and body size before the body
is read, `_auth_gate`), and the HTTP behaviours applied to the whole app (the `Host` check, `HEAD` on every `GET`
route, CORS: `_http`)."""
