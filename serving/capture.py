"""Which requests have their hidden states captured: a rule per workload, changeable at run time."""

from __future__ import annotations

import random
import re
import threading
from dataclasses import asdict, dataclass

# workload names become Kafka topic suffixes and metric labels: keep them short and plain
WORKLOAD_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,47}$")


def check_workload(name: str) -> str:
    if not WORKLOAD_NAME.match(name):
        raise ValueError(
            f"workload name {name!r} is not valid: 1-48 characters of a-z, 0-9, '_', '.', '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass
class CaptureRule:
    enabled: bool = True
    fraction: float = 1.0  # share of the workload's requests captured

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"capture fraction must be in [0, 1], got {self.fraction}")


def parse_rules(spec: str) -> dict[str, CaptureRule]:
    """'code=on,chat_fr=0.25,*=off' -> rules; '*' is the rule for workloads without one."""
    rules: dict[str, CaptureRule] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"capture rule {item!r}: expected WORKLOAD=on|off|FRACTION")
        if name != "*":
            check_workload(name)
        if value in ("on", "off"):
            rules[name] = CaptureRule(enabled=value == "on")
        else:
            try:
                rules[name] = CaptureRule(enabled=True, fraction=float(value))
            except ValueError:
                raise ValueError(f"capture rule {item!r}: expected on, off or a fraction in [0, 1]") from None
    return rules


class CapturePolicy:
    def __init__(self, rules: dict[str, CaptureRule] | None = None, seed: int = 0):
        rules = dict(rules or {})
        self.fallback = rules.pop("*", CaptureRule())  # for workloads without a rule of their own
        self.rules: dict[str, CaptureRule] = rules
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def rule(self, workload: str) -> CaptureRule:
        return self.rules.get(workload, self.fallback)

    def set(self, workload: str, rule: CaptureRule) -> None:
        with self._lock:
            self.rules[check_workload(workload)] = rule

    def decide(self, workload: str, opted_out: bool) -> bool:
        """Capture this request? The client's opt-out always wins."""
        if opted_out:
            return False
        r = self.rule(workload)
        with self._lock:
            return r.enabled and self._rng.random() < r.fraction

    def snapshot(self) -> dict[str, object]:
        return {"fallback": asdict(self.fallback), "workloads": {w: asdict(r) for w, r in self.rules.items()}}
