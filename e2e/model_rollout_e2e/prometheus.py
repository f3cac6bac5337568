"""A real Prometheus server (Debian's ``prometheus``) on loopback, scraping the targets
it is given, for the tests of the canary analysis' PromQL."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from .binaries import prometheus_binary
from .processes import free_port, http_ok, wait_until


class PrometheusServer:
    """``targets``: ``host:port`` of each server's ``/metrics``, with the labels its
    series get (as Kubernetes service discovery adds ``namespace`` and ``pod``)."""

    def __init__(
        self,
        work: Path,
        targets: list[tuple[str, dict[str, str]]],
        scrape_interval_s: float = 1.0,
    ) -> None:
        self.work = work
        self.targets = targets
        self.scrape_interval_s = scrape_interval_s
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _config(self) -> dict[str, Any]:
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        return {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {
                    "job_name": "model-server",
                    "metrics_path": "/metrics",
                    "static_configs": [
                        {"targets": [address], "labels": labels} for address, labels in self.targets
                    ],
                }
            ],
        }

    def start(self, timeout_s: float = 60.0) -> PrometheusServer:
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        config = self.work / "prometheus.yml"
        config.write_text(yaml.safe_dump(self._config()))
        log = (self.work / "prometheus.log").open("ab")
        self.proc = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={config}",
                f"--storage.tsdb.path={self.work / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log_tail()}")
            return http_ok(f"{self.url}/-/ready")

        wait_until(ready, timeout_s, 0.1, "prometheus to be ready")
        return self

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's vector (as the API answers it)."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        with urllib.request.urlopen(url, timeout=10) as response:
            answer = json.loads(response.read())
        assert answer["status"] == "success", answer
        return list(answer["data"]["result"])

    def scrapes(self) -> int:
        """Scrapes so far that found every target up (``up`` samples of all of them)."""
        result = self.query("count_over_time(up[1h])")
        counts = [int(float(r["value"][1])) for r in result]
        return min(counts) if len(counts) == len(self.targets) else 0

    def wait_for_scrapes(self, more: int, timeout_s: float = 60.0) -> None:
        """Until every target has been scraped ``more`` times from now on."""
        goal = self.scrapes() + more
        wait_until(lambda: self.scrapes() >= goal, timeout_s, 0.2, f"{more} more scrapes")

    def log_tail(self, lines: int = 30) -> str:
        path = self.work / "prometheus.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
