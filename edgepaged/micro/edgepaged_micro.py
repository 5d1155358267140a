# edgepaged_micro: a one-file client of the edgepaged protocol (docs/PROTOCOL.md) for
# MicroPython boards and IoT hubs. Copy this file to the board; it needs only `socket` and
# `struct` (no threads, no msgpack package: a small encoder/decoder for the subset the
# protocol uses), and it reads every frame into one preallocated buffer of `max_frame` bytes.
#
#     import edgepaged_micro
#     c = edgepaged_micro.Client("192.168.1.10", name="kitchen-hub")
#     for text in c.chat([{"role": "user", "content": "Is 17 C cold for a living room?"}], max_tokens=48):
#         print(text, end="")
#     print(c.done["usage"])
#     c.close()
#
# One request at a time, in the calling task: `chat`/`generate` yield text pieces as they come.
# To stop early, `close()` the answer (MicroPython does not close an abandoned generator; a new
# request also cancels one left unfinished): the server cancels it and frees its memory.
# Runs unchanged under CPython 3 (that is how it is tested).
import socket
import struct

PROTOCOL_VERSION = 1
DEFAULT_PORT = 7878


class ServerError(Exception):
    """An error frame (code is machine-readable), or a broken exchange (code `client`)."""

    def __init__(self, code, message):
        Exception.__init__(self, code + ": " + message)
        self.code = code
        self.message = message


# ------------------------------------------------------------------ msgpack, the subset used
# nil, bool, int (64-bit), float, str, bin, array, map. No extension types.

def _pack_int(n, out):
    # no literal beyond 32 bits: small ports may have no big integers (struct checks 64-bit range)
    if n >= 0:
        if n < 128:
            out.append(n)
        elif n < 256:
            out.append(0xCC)
            out.append(n)
        elif n < 65536:
            out.extend(struct.pack(">BH", 0xCD, n))
        elif n <= 0xFFFFFFFF:
            out.extend(struct.pack(">BI", 0xCE, n))
        else:
            out.extend(struct.pack(">BQ", 0xCF, n))
    elif n >= -32:
        out.append(n & 0xFF)
    elif n >= -128:
        out.extend(struct.pack(">Bb", 0xD0, n))
    elif n >= -32768:
        out.extend(struct.pack(">Bh", 0xD1, n))
    elif n >= -2147483648:
        out.extend(struct.pack(">Bi", 0xD2, n))
    else:
        out.extend(struct.pack(">Bq", 0xD3, n))


def _pack_len(n, fix, fix_max, c8, c16, c32, out):
    if n <= fix_max and fix is not None:
        out.append(fix | n)
    elif n < 256 and c8 is not None:
        out.append(c8)
        out.append(n)
    elif n < 65536:
        out.extend(struct.pack(">BH", c16, n))
    else:
        out.extend(struct.pack(">BI", c32, n))


def _pack(x, out, depth):
    if depth > 16:
        raise ValueError("nested too deep")
    if x is None:
        out.append(0xC0)
    elif x is True:
        out.append(0xC3)
    elif x is False:
        out.append(0xC2)
    elif isinstance(x, int):
        _pack_int(x, out)
    elif isinstance(x, float):
        out.extend(struct.pack(">Bd", 0xCB, x))
    elif isinstance(x, str):
        b = x.encode("utf-8")
        _pack_len(len(b), 0xA0, 31, 0xD9, 0xDA, 0xDB, out)
        out.extend(b)
    elif isinstance(x, (bytes, bytearray)):
        _pack_len(len(x), None, -1, 0xC4, 0xC5, 0xC6, out)
        out.extend(x)
    elif isinstance(x, (list, tuple)):
        _pack_len(len(x), 0x90, 15, None, 0xDC, 0xDD, out)
        for item in x:
            _pack(item, out, depth + 1)
    elif isinstance(x, dict):
        _pack_len(len(x), 0x80, 15, None, 0xDE, 0xDF, out)
        for k in x:
            _pack(k, out, depth + 1)
            _pack(x[k], out, depth + 1)
    else:
        raise TypeError("cannot pack " + str(type(x)))


def packb(x):
    out = bytearray()
    _pack(x, out, 0)
    return out


def _unpack(b, i, depth):
    """The value at b[i:], and the index after it."""
    if depth > 16:
        raise ValueError("nested too deep")
    c = b[i]
    i += 1
    if c < 0x80:
        return c, i
    if c >= 0xE0:
        return c - 256, i
    if 0xA0 <= c <= 0xBF:
        n = c & 0x1F
        return str(bytes(b[i:i + n]), "utf-8"), i + n
    if 0x90 <= c <= 0x9F:
        return _unpack_array(b, i, c & 0x0F, depth)
    if 0x80 <= c <= 0x8F:
        return _unpack_map(b, i, c & 0x0F, depth)
    if c == 0xC0:
        return None, i
    if c == 0xC2:
        return False, i
    if c == 0xC3:
        return True, i
    if c == 0xCC:
        return b[i], i + 1
    if c == 0xCD:
        return struct.unpack_from(">H", b, i)[0], i + 2
    if c == 0xCE:
        return struct.unpack_from(">I", b, i)[0], i + 4
    if c == 0xCF:
        return struct.unpack_from(">Q", b, i)[0], i + 8
    if c == 0xD0:
        return struct.unpack_from(">b", b, i)[0], i + 1
    if c == 0xD1:
        return struct.unpack_from(">h", b, i)[0], i + 2
    if c == 0xD2:
        return struct.unpack_from(">i", b, i)[0], i + 4
    if c == 0xD3:
        return struct.unpack_from(">q", b, i)[0], i + 8
    if c == 0xCA:
        return struct.unpack_from(">f", b, i)[0], i + 4
    if c == 0xCB:
        return struct.unpack_from(">d", b, i)[0], i + 8
    if c in (0xD9, 0xC4):
        n, i = b[i], i + 1
    elif c in (0xDA, 0xC5, 0xDC, 0xDE):
        n, i = struct.unpack_from(">H", b, i)[0], i + 2
    elif c in (0xDB, 0xC6, 0xDD, 0xDF):
        n, i = struct.unpack_from(">I", b, i)[0], i + 4
    else:
        raise ValueError("unsupported msgpack type 0x%02x" % c)
    if c in (0xD9, 0xDA, 0xDB):
        return str(bytes(b[i:i + n]), "utf-8"), i + n
    if c in (0xC4, 0xC5, 0xC6):
        return bytes(b[i:i + n]), i + n
    if c in (0xDC, 0xDD):
        return _unpack_array(b, i, n, depth)
    return _unpack_map(b, i, n, depth)


def _unpack_array(b, i, n, depth):
    out = []
    for _ in range(n):
        v, i = _unpack(b, i, depth + 1)
        out.append(v)
    return out, i


def _unpack_map(b, i, n, depth):
    out = {}
    for _ in range(n):
        k, i = _unpack(b, i, depth + 1)
        v, i = _unpack(b, i, depth + 1)
        out[k] = v
    return out, i


def unpackb(b):
    v, i = _unpack(b, 0, 0)
    if i != len(b):
        raise ValueError("trailing bytes")
    return v


# ------------------------------------------------------------------ the client

class Client:
    """One connection to an edgepaged server. `max_frame` bounds every frame it reads (the
    server's token and done frames are a few hundred bytes; `stats` about 2 KiB)."""

    def __init__(self, host, port=DEFAULT_PORT, token=None, name="micro", timeout=60, max_frame=4096):
        self.buf = bytearray(max_frame)
        self.view = memoryview(self.buf)
        self.next_id = 1
        self.done = None          # the last request's done frame
        self.active = None        # the id of a request not read to its end
        self.info = None          # the server's hello
        try:
            addr = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0][-1]
        except OSError as e:
            raise ServerError("unreachable", "cannot resolve %s: %s" % (host, e))
        self.sock = socket.socket()
        try:
            self.sock.settimeout(timeout)
            try:
                self.sock.connect(addr)
            except OSError as e:
                raise ServerError("unreachable", "cannot connect to %s:%d: %s" % (host, port, e))
            hello = {"type": "hello", "version": PROTOCOL_VERSION, "client": name}
            if token is not None:
                hello["token"] = token
            self._send(hello)
            reply = self._recv()
            if reply.get("type") == "error":
                raise ServerError(reply.get("code", "?"), reply.get("message", ""))
            self.info = reply
        except BaseException:
            self.sock.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.sock.close()

    # -- frames
    def _send(self, msg):
        body = packb(msg)
        self.sock.sendall(struct.pack(">I", len(body)) + body)

    def _read_exact(self, n):
        """n bytes into the front of the buffer."""
        got = 0
        while got < n:
            chunk = self.sock.recv(min(n - got, 1024))
            if not chunk:
                raise ServerError("connection_lost", "the server closed the connection")
            self.buf[got:got + len(chunk)] = chunk
            got += len(chunk)

    def _skip(self, n):
        while n > 0:
            chunk = self.sock.recv(min(n, 1024))
            if not chunk:
                raise ServerError("connection_lost", "the server closed the connection")
            n -= len(chunk)

    def _recv(self):
        self._read_exact(4)
        n = struct.unpack_from(">I", self.buf, 0)[0]
        if n > len(self.buf):
            self._skip(n)    # stay in step with the stream, then say why
            raise ServerError("frame_too_large", "a frame of %d bytes is over max_frame (%d)" % (n, len(self.buf)))
        self._read_exact(n)
        return unpackb(self.view[:n])

    # -- requests
    def _request(self, frame, sampling):
        if self.active is not None:
            self._cancel(self.active)
        rid = self.next_id
        self.next_id += 1
        frame["id"] = rid
        for k in sampling:
            if sampling[k] is not None:
                frame[k] = sampling[k]
        self.done = None
        self._send(frame)
        self.active = rid
        finished = False
        try:
            while True:
                m = self._recv()
                if m.get("id") != rid:
                    continue
                kind = m.get("type")
                if kind == "token":
                    if m.get("text"):
                        yield m["text"]
                elif kind == "done":
                    finished = True
                    self.done = m
                    err = m.get("error")
                    if m.get("finish_reason") == "error" or (err and m.get("finish_reason") == "cancelled"):
                        raise ServerError(err.get("code", "?"), err.get("message", ""))
                    return
                elif kind == "error":
                    finished = True
                    raise ServerError(m.get("code", "?"), m.get("message", ""))
        finally:
            if finished:
                self.active = None
            else:                   # left early: cancel, and read up to the request's end
                self._cancel(rid)

    def _cancel(self, rid):
        self.active = None
        try:
            self._send({"type": "cancel", "id": rid})
            while True:
                m = self._recv()
                if m.get("id") == rid and m.get("type") in ("done", "error"):
                    self.done = m if m.get("type") == "done" else None
                    return
        except (OSError, ServerError):
            self.close()

    def chat(self, messages, max_tokens=None, temperature=None, **sampling):
        """Yield the answer's text pieces. messages: [{"role": ..., "content": ...}, ...]."""
        sampling["max_tokens"] = max_tokens
        sampling["temperature"] = temperature
        return self._request({"type": "chat", "messages": messages}, sampling)

    def generate(self, prompt, max_tokens=None, temperature=None, **sampling):
        sampling["max_tokens"] = max_tokens
        sampling["temperature"] = temperature
        return self._request({"type": "generate", "prompt": prompt}, sampling)

    def ask(self, question, system=None, max_tokens=64, temperature=0, **sampling):
        """The whole answer to one question, as a string."""
        messages = [{"role": "user", "content": question}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        return "".join(self.chat(messages, max_tokens=max_tokens, temperature=temperature, **sampling))

    def stats(self):
        if self.active is not None:
            self._cancel(self.active)
        rid = self.next_id
        self.next_id += 1
        self._send({"type": "stats", "id": rid})
        while True:
            m = self._recv()
            if m.get("id") == rid:
                if m.get("type") == "error":
                    raise ServerError(m.get("code", "?"), m.get("message", ""))
                return m["stats"]
