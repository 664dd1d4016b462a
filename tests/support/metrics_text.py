"""Parse a Prometheus exposition (prometheus-client's own parser) into samples."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: dict[tuple[str, tuple], float] = {}
        # the same series without the deployment-wide model_name label (one model a host)
        self.unlabelled: dict[tuple[str, tuple], float] = {}
        for family in self.families.values():
            for s in family.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
                rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                self.unlabelled[(s.name, rest)] = s.value

    def value(self, name: str, **labels: str) -> float:
        """One series' value; ``model_name`` need not be named."""
        key = (name, tuple(sorted(labels.items())))
        return self.samples.get(key, self.unlabelled.get(key, 0.0))

    def total(self, name: str, **labels: str) -> float:
        """Sum over every label set that includes ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= set(ls))

    def sample_names(self) -> set[str]:
        return {n for n, _ in self.samples}


def scrape(server, path: str = "/metrics") -> Scrape:
    status, body = server.get(path)
    assert status == 200, body
    return Scrape(body.decode())
