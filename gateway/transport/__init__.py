"""HTTP/1.1 transport limits: header size and count, header and body read deadlines, connections.

uvicorn (with httptools, the parser ``serve`` runs) bounds none of these: a client may send
headers without end, one byte at a time (slowloris), or dribble a body forever, and every
such connection costs a file descriptor and memory until it gives up.
:class:`~.http_protocol.LimitedHttpProtocol`
is uvicorn's :class:`~uvicorn.protocols.http.httptools_impl.HttpToolsProtocol` with the limits
that servers such as Apache (``mod_reqtimeout``: ``header=20-40,MinRate=500 body=20,MinRate=500``,
``LimitRequestFieldSize``/``LimitRequestFields``), nginx (``client_header_timeout``,
``large_client_header_buffers``) and Node.js (``headersTimeout``, ``maxHeaderSize``) apply:

* **Head size and count.** The URL plus every header name and value of one request may hold
  ``max_header_bytes`` bytes, and a request at most ``max_headers`` header fields; past either,
  ``431 Request Header Fields Too Large`` and the connection closes. A head still incomplete
  after ``2 * max_header_bytes + 4 * max_headers`` raw bytes (delimiters and whitespace
  included) is refused the same way, so a header that never ends is never buffered further.
* **Head deadline.** A request's head must arrive within ``header_timeout`` seconds of its first
  byte (of the connection's opening for the first request): else ``408 Request Timeout`` and the
  connection closes (closed without an answer when not one byte came). Idle keep-alive time
  between requests is uvicorn's own ``timeout_keep_alive``.
* **Body deadline.** A body must arrive within ``body_timeout + received / body_min_rate``
  seconds of its head (Apache's ``MinRate``: each byte received earns ``1 / body_min_rate`` s
  more); else ``408`` when no answer was started (the app sees the client gone) and the
  connection closes. Time while the server itself stops reading (the app has not consumed the
  body yet; a pipelined request waits its turn) counts against neither deadline
  (:class:`~gateway.transport.http_protocol.PauseClock`).
* **Write deadline.** When the client stops taking the response (the transport's buffer
  passes its 64 KiB high-water mark, so uvicorn's sends wait), the write must resume within
  ``write_timeout`` seconds plus one second per ``write_min_rate`` bytes the client takes
  meanwhile (nginx's ``send_timeout``, with ``mod_reqtimeout``'s ``MinRate`` scheme for a
  slow but honest reader); past it the connection is reset (``SO_LINGER`` 0, nginx's
  ``reset_timedout_connection``), the app sees the client gone, and a chat request is aborted
  in the engine and billed ``aborted`` (``write_timeout``). uvicorn bounds no write: a client
  that never reads held its response, its task and its key's slot forever (issue 27).
* **Open connections.** At most ``max_connections``; when a new one would pass it, the
  connection that has waited longest without a request running (idle keep-alive, or still
  sending its head) is closed to make room; if there is none, the writer whose client has
  stopped reading for longest (paused for ``stalled_after`` seconds or more) is reset; when
  every connection is serving a client that reads, the new one gets ``503`` and is closed. A
  slowloris or a reader that never reads is evicted by newcomers; clients being served are
  never touched.
* **One key's share.** A connection counts for the API key of its last authenticated request
  (``Exchange.serve_key``, from the auth middleware); one key holds at most
  ``max_connections_per_key`` (a quarter of ``max_connections`` unless set) at once. Past it
  the key's longest-idle connection is closed to make room, else the request gets ``429``
  (``too_many_connections``, ``Retry-After: 1``) and its connection closes.

A request costs nothing extra when it arrives in one read: the timers are armed only for heads
and bodies still incomplete after a read, and for writes the client stopped taking. Refusals
are counted (:class:`~.connections.ConnectionTable`) and summed up in one log line a minute at most.

One module per idea, imported one way (``limits`` <- ``connections`` <- ``http_protocol`` <-
``uvicorn_config``):

* :mod:`.limits`: :class:`~.limits.TransportLimits`, the numbers.
* :mod:`.connections`: :class:`~.connections.ConnectionTable`, one server's open connections.
* :mod:`.http_protocol`: :class:`~.http_protocol.LimitedHttpProtocol` and each request's
  :class:`~.http_protocol.Exchange`; :func:`~.http_protocol.limited_protocol` makes the
  protocol class for one server (``uvicorn.Config(http=...)``).
* :mod:`.uvicorn_config`: the whole uvicorn configuration for the gateway, the connection cap
  fitted to the open-files limit.
* :mod:`.graceful` (uvicorn's server with the gateway's shutdown), :mod:`.access_log`,
  :mod:`.json_body` (request bodies decoded as JSON, 400 for anything malformed).

docs/transport.md describes the limits for operators.
"""
