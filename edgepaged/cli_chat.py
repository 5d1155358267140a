"""`edgepaged chat`: the conversation loop, in a plain thread over SyncClient.

Ctrl-C during an answer cancels that request on the server and keeps the conversation
(the partial answer stays in it); Ctrl-C at the prompt clears the line; Ctrl-D leaves.
"""
from __future__ import annotations

import sys

from .client import ServerError, SyncClient

HELP = "/reset clears the conversation, /system TEXT sets the system prompt, Ctrl-C stops an answer, Ctrl-D leaves"


class ChatSession:
    def __init__(self, client: SyncClient, *, system: str | None = None, max_tokens: int | None = None,
                 temperature: float = 0.0, out=None, err=None):
        self.client, self.system = client, system
        self.params = {"max_tokens": max_tokens, "temperature": temperature}
        self.history: list[dict] = []
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.prompt = "> " if sys.stdin.isatty() else ""

    def say(self, text: str) -> None:
        self.err.write(text + "\n")
        self.err.flush()

    def run(self) -> None:
        info = self.client.info
        if sys.stdin.isatty():
            try:
                import readline  # noqa: F401  (line editing and history for input())
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
            line = line.strip()
            if not line:
                continue
            if line.startswith("/") and self.command(line):
                continue
            self.turn(line)

    def command(self, line: str) -> bool:
        """Handle a /command; False when the line is not one (it is sent as text)."""
        name, _, arg = line.partition(" ")
        if name == "/reset":
            self.history.clear()
            self.say("(conversation cleared)")
        elif name == "/system":
            self.system = arg.strip() or None
            self.say(f"(system prompt: {self.system!r})" if self.system else "(system prompt: the model's default)")
        elif name in ("/help", "/?"):
            self.say(HELP)
        elif name in ("/exit", "/quit", "/bye"):
            raise SystemExit(0)
        else:
            return False
        return True

    def turn(self, text: str) -> None:
        user = {"role": "user", "content": text}
        system = [{"role": "system", "content": self.system}] if self.system else []
        stream = None
        try:
            stream = self.client.chat(system + self.history + [user], **self.params)
            for piece in stream:
                self.out.write(piece)
                self.out.flush()
            self.out.write("\n")
        except KeyboardInterrupt:
            if stream is not None:
                try:
                    stream.cancel()
                except (KeyboardInterrupt, ServerError):
                    pass
            self.out.write("\n")
            self.say("[stopped]")
        except ServerError as e:
            self.out.write("\n")
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
        if done and done.get("error"):
            self.say(f"[{done['error'].get('message')}]")
        elif done and done.get("finish_reason") == "length":
            self.say("[max tokens reached]")
        if answer or done:
            self.history += [user, {"role": "assistant", "content": answer}]
