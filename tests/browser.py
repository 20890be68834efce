"""A headless Chromium driven through the DevTools protocol over a pipe (`--remote-debugging-pipe`: JSON messages
ending in NUL on file descriptors 3 and 4), with the standard library only: open a page, run JavaScript in it (click,
type, read the DOM), wait for it, take a screenshot. The tests that use it skip, naming why, where Chromium is absent.

    with Browser() as browser:
        browser.open("file:///.../index.html")
        browser.evaluate("document.querySelector('button').click()")
"""

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time

import pytest


EXECUTABLES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# a container has no user namespaces for Chromium's sandbox, and no GPU
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--no-default-browser-check", "--remote-debugging-pipe")  # fmt: skip


def chromium_or_skip() -> str:
    """The Chromium executable, or a skip naming how to install it."""
    for name in EXECUTABLES:
        found = shutil.which(name)
        if found:
            return found
    pytest.skip(f"no Chromium ({', '.join(EXECUTABLES)}) on PATH: install Debian's `chromium` package (apt-get install chromium)")


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with one page; `timeout` (seconds) bounds every wait."""

    def __init__(self, executable: str | None = None, width: int = 1400, height: int = 1000, timeout: float = 30):
        self.executable = executable or chromium_or_skip()
        self.width, self.height, self.timeout = width, height, timeout

    def __enter__(self) -> "Browser":
        self.profile = tempfile.mkdtemp(prefix="pkm-chromium-")
        self._log = open(os.path.join(self.profile, "chromium.log"), "w+b")  # a file: a full pipe would block it
        to_browser_read, self._write = os.pipe()
        self._read, from_browser_write = os.pipe()
        # Chromium reads commands on fd 3 and writes replies on fd 4: the child moves the pipe ends there (via high
        # numbers, in case one of them is 3 or 4 already); dup2 makes them inheritable, Python's other fds are not
        def pipe_ends_at_3_and_4():
            os.dup2(to_browser_read, 1000)
            os.dup2(from_browser_write, 1001)
            os.dup2(1000, 3)
            os.dup2(1001, 4)
            os.close(1000)
            os.close(1001)

        self.process = subprocess.Popen(
            [self.executable, *FLAGS, f"--user-data-dir={self.profile}", f"--window-size={self.width},{self.height}",
             "about:blank"],
            preexec_fn=pipe_ends_at_3_and_4, close_fds=False, stdout=subprocess.DEVNULL, stderr=self._log,
        )  # fmt: skip
        os.close(to_browser_read)
        os.close(from_browser_write)
        self._buffer, self._next_id, self.session = b"", 0, None
        try:
            target = self.command("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.command("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            self.command("Page.enable")
            self.command("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                         deviceScaleFactor=1, mobile=False)  # fmt: skip
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        for fd in (self._write, self._read):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def command(self, method: str, **params) -> dict:
        """Sends one DevTools command (to the page once attached) and returns its result."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if self.session is not None:
            message["sessionId"] = self.session
        try:
            os.write(self._write, json.dumps(message).encode() + b"\0")
        except BrokenPipeError:
            raise BrowserError(f"Chromium exited: {self._stderr_tail()}") from None
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def _message(self, deadline: float) -> dict:
        import select

        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise BrowserError(f"Chromium did not answer within {self.timeout} s")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium exited: {self._stderr_tail()}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _stderr_tail(self) -> str:
        self.process.wait(10)
        self._log.seek(0)
        return f"exit status {self.process.returncode}, " + self._log.read().decode(errors="replace")[-2000:]

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-serialisable values)."""
        result = self.command("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str = ""):
        """Polls until the expression is truthy; returns its value."""
        deadline = time.monotonic() + self.timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"waited {self.timeout} s for {what or expression}")
            time.sleep(0.05)

    def open(self, url: str) -> None:
        self.command("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", f"{url} to load")

    def screenshot(self, path) -> bytes:
        png = base64.b64decode(self.command("Page.captureScreenshot", format="png")["data"])
        with open(path, "wb") as handle:
            handle.write(png)
        return png
