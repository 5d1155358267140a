"""`edgepaged chat`: the conversation loop, in a plain thread over SyncClient.

Ctrl-C during an answer cancels that request on the server and keeps the conversation
(the partial answer stays in it); Ctrl-C at the prompt clears the line; Ctrl-D leaves.
"""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager

from .markdown import ThinkingView, writer_for
from . import ServerError, SyncClient

HELP = ('/reset clears the conversation, /system TEXT sets the system prompt, """ opens a multi-line message, '
        "/image FILE attaches an image to your next message (a vision model), /show, /set parameter NAME VALUE, /set think, /set nothink, /save FILE, /load FILE, Ctrl-C stops an answer, "
        "Ctrl-D leaves")
# /set parameter NAME: the request field it sets, and its type (Ollama's names too)
PARAMETERS = {"temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
              "min_p": ("min_p", float), "seed": ("seed", int), "max_tokens": ("max_tokens", int),
              "num_predict": ("max_tokens", int), "repeat_penalty": ("repetition_penalty", float),
              "repetition_penalty": ("repetition_penalty", float)}


@contextmanager
def _nothing():
    yield


@contextmanager
def quiet_terminal(stream):
    """While an answer streams: what is typed is not echoed into it, and is dropped after."""
    try:
        import termios
        fd = stream.fileno()
        old = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError, AttributeError):
        yield
        return
    new = termios.tcgetattr(fd)
    new[3] &= ~termios.ECHO
    try:
        termios.tcsetattr(fd, termios.TCSANOW, new)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, old)
        termios.tcflush(fd, termios.TCIFLUSH)


class ChatSession:
    def __init__(self, client: SyncClient, *, system: str | None = None, max_tokens: int | None = None,
                 temperature: float = 0.0, out=None, err=None, plain: bool = False, hide_thinking: bool = False):
        self.client, self.system = client, system
        self.hide_thinking = hide_thinking
        self.plain = plain                # no Markdown rendering (it is off anyway when stdout is no terminal)
        self.params = {"max_tokens": max_tokens, "temperature": temperature}
        self.history: list[dict] = []
        self.told_truncated = False       # "the oldest messages no longer fit" is said once
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.prompt = "> " if sys.stdin.isatty() else ""
        self.images: list[bytes] = []     # attached by /image FILE, sent with the next message

    def say(self, text: str) -> None:
        self.err.write(text + "\n")
        self.err.flush()

    def run(self) -> None:
        info = self.client.info
        if sys.stdin.isatty():
            try:
                import readline  # line editing and history for input()
                # a pasted paragraph arrives as one line of input, newlines and all
                readline.parse_and_bind("set enable-bracketed-paste on")
            except ImportError:
                pass
        self.say(f"connected to {self.client.address}: {info.get('model')}, context {info.get('context_length')} "
                 f"tokens. {HELP}.")
        while True:
            try:
                line = input(self.prompt)
            except EOFError:
                self.out.write("\n")
                return
            except KeyboardInterrupt:
                self.out.write("\n")
                continue
            if line.lstrip().startswith('"""'):     # a multi-line message, up to a line ending with """
                line = self.block(line.lstrip()[3:])
                if line is None:
                    continue
            line = line.strip()
            if not line:
                continue
            if line.startswith("/") and not line.startswith("//"):
                if not self.command(line):
                    self.say(f"[unknown command {line.split()[0]}: /help lists them; start with // to send a "
                             "line that begins with /]")
                continue
            self.turn(line[1:] if line.startswith("//") else line)

    def block(self, first: str) -> str | None:
        """The lines of a \"\"\" block (the opening line's rest included); None at Ctrl-C/Ctrl-D."""
        lines = [first]
        while not lines[-1].rstrip().endswith('"""'):
            try:
                lines.append(input("... " if self.prompt else ""))
            except (EOFError, KeyboardInterrupt):
                self.out.write("\n")
                return None
        lines[-1] = lines[-1].rstrip()[:-3]
        return "\n".join(lines)

    def command(self, line: str) -> bool:
        """Handle a /command; False when the line is not one (it is sent as text)."""
        name, _, arg = line.partition(" ")
        if line.strip() in ("/set think", "/set nothink"):     # as in `ollama run`
            self.params["think"] = line.strip() == "/set think"
            self.say("(thinking on)" if self.params["think"] else "(thinking off: the model answers at once)")
            return True
        if name == "/reset":
            self.history.clear()
            self.say("(conversation cleared)")
        elif name == "/system":
            self.system = arg.strip() or None
            self.say(f"(system prompt: {self.system!r})" if self.system else "(system prompt: the model's default)")
        elif name == "/image":
            path = arg.strip()
            if not path:
                self.say("[/image FILE: an image for your next message]")
                return True
            from .images import image_for_frame
            try:
                self.images.append(image_for_frame(path))
            except (OSError, ValueError) as e:
                self.say(f"[cannot attach {path}: {getattr(e, 'strerror', None) or e}]")
                return True
            self.say(f"(image attached: {len(self.images)} for your next message)")
        elif name in ("/help", "/?"):
            self.say(HELP)
        elif name == "/show":
            info = self.client.info
            self.say(f"model {info.get('model')}, context {info.get('context_length')} tokens, server "
                     f"{self.client.address} ({info.get('server')}); system prompt "
                     f"{self.system!r}; settings {json.dumps(self.params)}; {len(self.history) // 2} turns")
        elif name == "/set":
            self.set(arg)
        elif name in ("/save", "/load"):
            path = arg.strip()
            if not path:
                self.say(f"[{name} FILE]")
            elif name == "/save":
                self.save(path)
            else:
                self.load(path)
        elif name in ("/exit", "/quit", "/bye"):
            raise SystemExit(0)
        else:
            return False
        return True

    def set(self, arg: str) -> None:
        parts = arg.split(None, 2)
        if len(parts) >= 2 and parts[0] == "system":
            self.system = arg.split(None, 1)[1].strip() or None
            self.say(f"(system prompt: {self.system!r})")
            return
        if len(parts) != 3 or parts[0] != "parameter" or parts[1] not in PARAMETERS:
            self.say(f"[/set parameter NAME VALUE, NAME one of {', '.join(PARAMETERS)}; or /set system TEXT]")
            return
        field, kind = PARAMETERS[parts[1]]
        try:
            value = kind(parts[2])
        except ValueError:
            self.say(f"[{parts[1]} takes {'an integer' if kind is int else 'a number'}, not {parts[2]!r}]")
            return
        self.params[field] = value
        self.say(f"(set {field} {value})")

    def save(self, path: str) -> None:
        import base64
        messages = [{**m, "images": [base64.b64encode(x).decode() for x in m["images"]]} if m.get("images") else m
                    for m in self.history]       # (images as base64, as Ollama's API has them)
        data = {"system": self.system, "messages": messages, "params": self.params,
                "model": self.client.info.get("model")}
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False, indent=1)
        except OSError as e:
            self.say(f"[cannot save to {path}: {e.strerror or e}]")
            return
        self.say(f"(saved {len(self.history)} messages to {path})")

    def load(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            messages = data["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                          and isinstance(m.get("content"), str) for m in messages):
                raise ValueError("messages must be a list of {role, content}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.say(f"[cannot load {path}: {getattr(e, 'strerror', None) or e}]")
            return
        import base64
        import binascii
        try:
            messages = [{**m, "images": [base64.b64decode(x, validate=True) for x in m["images"]]}
                        if m.get("images") else m for m in messages]
        except (binascii.Error, TypeError, ValueError):
            self.say(f"[cannot load {path}: an image is not base64]")
            return
        self.history = messages
        self.system = data.get("system") or self.system
        if isinstance(data.get("params"), dict):
            self.params.update({k: v for k, v in data["params"].items() if k in {f for f, _ in PARAMETERS.values()}})
        self.say(f"(loaded {len(messages)} messages from {path})")

    def turn(self, text: str) -> None:
        user = {"role": "user", "content": text}
        if self.images:         # (they stay in the conversation: the box finds them again by their content)
            user["images"], self.images = self.images, []
        system = [{"role": "system", "content": self.system}] if self.system else []
        stream = None
        writer = writer_for(self.out, self.plain)
        view = ThinkingView(self.out, self.plain, self.hide_thinking)
        try:
            stream = self.client.chat(system + self.history + [user], truncate="auto", **self.params)
            with quiet_terminal(sys.stdin) if sys.stdin.isatty() else _nothing():
                for piece in stream:
                    view.pass_on(stream.last_thinking, piece, writer)
            view.close()
            writer.close()
        except KeyboardInterrupt:
            view.close()
            if stream is not None:
                try:
                    stream.cancel()
                except (KeyboardInterrupt, ServerError):
                    pass
            writer.close()
            self.say("[stopped]")
        except ServerError as e:
            view.close()
            writer.close()
            self.say(f"[error] {e.message}" + (" (try /reset)" if e.code in ("prompt_too_long", "context_exceeded")
                                               else ""))
            if e.code == "connection_lost":
                raise SystemExit(1)
            return
        answer = stream.text if stream is not None else ""
        done = stream.done if stream is not None else None
        if done and done.get("finish_reason") == "error":
            self.say(f"[error] {(done.get('error') or {}).get('message', 'the request failed')}")
            return
        if done and done.get("truncated_messages") and not self.told_truncated:
            self.told_truncated = True
            self.say(f"[the conversation is longer than the model's context: the oldest "
                     f"{done['truncated_messages']} messages were left out of this answer (and will be of the "
                     "next ones); /reset starts afresh]")
        if done and done.get("error"):
            self.say(f"[{done['error'].get('message')}]")
        elif done and done.get("finish_reason") == "length":
            self.say("[max tokens reached]")
        if answer or done:
            self.history += [user, {"role": "assistant", "content": answer}]
