"""The playground page in a real browser (the system's Chromium, driven by Playwright) against a live
stack: tokens arrive while the job runs, a cancelled job ends `cancelled`, the queues show, and the
page works once auth is turned on (with the key typed into it).

Set PLAYGROUND_SCREENSHOT=docs/playground.png to write the screenshot the docs show."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, start_stack

CHROMIUM = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if Path(p).exists()), None)
CHROMIUM = CHROMIUM or shutil.which("chromium") or shutil.which("chromium-browser")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the dev extra)")
# the playground in Chromium against a whole stack
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        CHROMIUM is None, reason="no Chromium found (/usr/bin/chromium): apt-get install chromium"
    ),
]


@pytest.fixture(scope="module")
def live(tmp_path_factory, redis_url, tiny_model):  # type: ignore[no-untyped-def]
    stack = start_stack(
        tmp_path_factory.mktemp("playground"),
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        extra_env={"CONVEYOR_TORCH_THREADS": "1"},
    )
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def browser():  # type: ignore[no-untyped-def]
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def open_page(browser, live):  # type: ignore[no-untyped-def]
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(live.url + "/")  # redirects to /playground
    assert page.url.endswith("/playground")
    page.wait_for_selector("#model option", state="attached")
    return page


def submit(page, prompt: str, *, max_tokens: int, ignore_eos: bool = True) -> str:  # type: ignore[no-untyped-def]
    page.fill("#prompt", prompt)
    page.fill("#max-tokens", str(max_tokens))
    page.set_checked("#ignore-eos", ignore_eos)
    page.click("#submit")
    # Selectors, not wait_for_function: the page's Content-Security-Policy forbids evaluating strings.
    page.wait_for_selector("#job-id:text-matches('^job '), #error:text-matches('.')", state="attached")
    assert not page.text_content("#error"), page.text_content("#error")
    return str(page.text_content("#job-id")).removeprefix("job ")


def test_tokens_stream_in_before_the_job_ends(browser, live) -> None:  # type: ignore[no-untyped-def]
    page = open_page(browser, live)
    page.select_option("#priority", "high")
    job_id = submit(page, "Tell me a long story.", max_tokens=200)
    page.wait_for_selector("#status.succeeded", timeout=60_000)
    first_token_seen = float(page.get_attribute("#output", "data-first-token-at") or 0)
    with live.client() as client:
        job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["priority"] == "high"
    # The page showed its first token before the job had finished: it streamed, not waited.
    assert 0 < first_token_seen < job["timings"]["finished_at"]
    assert page.text_content("#output") == job["text"]
    # The timeline shows every step with its time, and the batch.
    for step in ("created_at", "scheduled_at", "started_at", "first_token_at", "finished_at"):
        assert "ms" in str(page.text_content(f"tr[data-step={step}]")) or step == "created_at"
    assert "job(s)" in str(page.text_content("#batch"))
    assert page.locator(".queue[data-class=realtime]").count() == 1
    screenshot = os.environ.get("PLAYGROUND_SCREENSHOT")
    if screenshot:
        page.screenshot(path=str(ROOT / screenshot), full_page=True)
    page.close()


def test_the_page_shows_a_batchs_progress(browser, live) -> None:  # type: ignore[no-untyped-def]
    lines = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": f"Count to {i}", "max_tokens": 4, "temperature": 0},
        }
        for i in range(3)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    with live.client() as client:
        uploaded = client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
        batch = client.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/completions",
                "completion_window": "24h",
            },
        ).json()
    page = open_page(browser, live)
    row = f".batch[data-batch={batch['id']}]"
    page.wait_for_selector(f"{row}[data-status=completed]", state="attached", timeout=60_000)
    assert page.text_content(f"{row} .n") == "completed 3/3"
    page.close()


def test_a_running_job_cancelled_from_the_page_ends_cancelled(browser, live) -> None:  # type: ignore[no-untyped-def]
    page = open_page(browser, live)
    job_id = submit(page, "Count to a thousand.", max_tokens=460)
    page.wait_for_selector("#output:text-matches('.')", state="attached")
    page.click("#cancel")
    page.wait_for_selector("#status.cancelled", timeout=30_000)
    with live.client() as client:
        job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "cancelled"
    assert job["usage"]["completion_tokens"] < 460
    page.close()


def test_with_auth_on_the_page_sends_the_key_typed_into_it(browser, tmp_path, redis_url, tiny_model):  # type: ignore[no-untyped-def]
    live = start_stack(
        tmp_path,
        redis_url=redis_url,
        models={"tiny": tiny_model},
        default_model="tiny",
        extra_env={"CONVEYOR_TORCH_THREADS": "1", "CONVEYOR_AUTH": "keys"},
    )
    try:
        _the_page_with_a_key(browser, live)
    finally:
        live.stop()


def _the_page_with_a_key(browser, live) -> None:  # type: ignore[no-untyped-def]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_") and k != "REDIS_URL"}
    env.update({"CONVEYOR_NAMESPACE": live.namespace, "REDIS_URL": live.redis_url or ""})
    with httpx.Client(base_url=live.url) as client:
        assert client.get("/v1/models").status_code == 401  # no credential exists yet: closed
    made = subprocess.run(
        [sys.executable, "-m", "app.cli", "keys", "create", "--tenant", "browser"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    key = next(word for word in made.stdout.split() if word.startswith("cvk_"))
    page = browser.new_page()
    page.goto(live.url + "/playground")
    page.wait_for_selector("#error:text-matches('401')", state="attached")
    page.fill("#key", key)
    page.dispatch_event("#key", "change")
    page.wait_for_selector("#model option", state="attached")
    submit(page, "Hello", max_tokens=8)
    page.wait_for_selector("#status.succeeded", timeout=60_000)
    assert page.text_content("#output")
    page.close()
