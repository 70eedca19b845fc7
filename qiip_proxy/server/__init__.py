"""The HTTP server every serving process runs: uvicorn with the daemon's limits (`_server`), the transport limits
inside uvicorn's HTTP/1.1 protocol (`_transport`), the cap on client connections (`_connection_cap`), the
open-file limit (`_limits`) and the garbage collector's tuning (`_gc`)."""
