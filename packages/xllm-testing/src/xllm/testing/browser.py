"""A real headless Chromium (Debian ``chromium`` and ``chromium-driver``) driven by Selenium, for the tests
of pages the gateway serves (``/dashboard``).

Debian's browser and driver are used as they are: a test tool's own browser download cannot work on
machines without the internet, so :func:`ensure_chromium` installs the Debian packages when
``/usr/bin/chromium`` is missing, as :mod:`xllm.testing.prometheus` installs Prometheus. Each
:class:`Browser` runs with a fresh profile (``--user-data-dir`` in the test's temporary folder) and no
background traffic (no component updates, no first-run, no sync). What the page logs to its console is
collected (:meth:`Browser.console`, :meth:`Browser.errors`); screenshots are kept as test artifacts under
``$XLLM_TEST_ARTIFACTS`` (default ``test-artifacts/`` at the repository root, ignored by git).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from xllm.testing.processes import apt_install

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS_ENV = "XLLM_TEST_ARTIFACTS"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage",
                  "--disable-extensions", "--disable-sync", "--no-default-browser-check", "--mute-audio")


def ensure_chromium() -> tuple[str, str]:
    """(browser, driver) paths, installing Debian's ``chromium`` and ``chromium-driver`` when missing (CI runs
    as root; elsewhere the test is skipped)."""
    apt_install(["chromium", "chromium-driver"],
                lambda: os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK),
                "chromium is not installed")
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            raise RuntimeError(f"chromium installed but {path} is missing")
    return CHROMIUM, CHROMEDRIVER


def repo_root(start: Path | None = None) -> Path:
    """The repository holding ``start`` (default: the working directory): the nearest folder with a
    ``noxfile.py``, else ``start`` itself."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "noxfile.py").is_file():
            return folder
    return here


def artifacts_dir() -> Path:
    """Where tests keep their artifacts (screenshots): ``$XLLM_TEST_ARTIFACTS`` or ``test-artifacts/`` at
    the repository root; created."""
    path = Path(os.environ.get(ARTIFACTS_ENV) or repo_root() / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Browser:
    """One headless Chromium session (a Selenium ``webdriver.Chrome`` as :attr:`driver`)."""

    def __init__(self, driver: Any, artifacts: Path) -> None:
        self.driver = driver
        self.artifacts = artifacts
        self.logs: list[dict] = []  # every console entry read so far

    def open(self, url: str) -> None:
        self.driver.get(url)

    def console(self) -> list[dict]:
        """The console entries logged since the last call (each ``{level, message, timestamp, source}``);
        all of them stay in :attr:`logs`."""
        new = list(self.driver.get_log("browser"))
        self.logs += new
        return new

    def errors(self, allow: Callable[[dict], bool] = lambda _e: False) -> list[dict]:
        """The ``SEVERE`` console entries since the last read that ``allow`` does not accept."""
        return [e for e in self.console() if e.get("level") == "SEVERE" and not allow(e)]

    def screenshot(self, name: str) -> Path:
        """Save the window as ``<artifacts>/<name>.png``; its path."""
        path = self.artifacts / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def wait(self, predicate: Callable[[Any], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
        """Poll ``predicate(driver)`` until it is truthy (returned); fails naming ``what`` and the console. An
        element the page replaced while the predicate read it (stale) counts as not yet."""
        from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException, TimeoutException
        from selenium.webdriver.support.ui import WebDriverWait

        try:
            return WebDriverWait(self.driver, timeout, poll_frequency=interval,
                                 ignored_exceptions=(StaleElementReferenceException, NoSuchElementException)
                                 ).until(predicate)
        except TimeoutException:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; console: "
                                 f"{[e.get('message') for e in self.console()][-10:]}") from None

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def quit(self) -> None:
        self.driver.quit()


@contextmanager
def headless_chromium(work: Path, width: int = 1440, height: int = 1000) -> Iterator[Browser]:
    """A headless Chromium with a fresh profile under ``work``, a ``width`` x ``height`` window and its
    console collected; quit (browser and driver processes) at the end."""
    chromium, chromedriver = ensure_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = Path(work) / "chromium-profile"
    shutil.rmtree(profile, ignore_errors=True)
    profile.mkdir(parents=True)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=chromedriver, log_output=str(Path(work) / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    browser = Browser(driver, artifacts_dir())
    try:
        yield browser
    finally:
        browser.quit()
