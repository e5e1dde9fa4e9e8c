"""The chart's alerts, run by Prometheus' own rule engine: the PrometheusRule is
rendered from the chart, its groups written as a rules file, checked with
`promtool check rules` and unit-tested with `promtool test rules` (alerts_test.yaml:
every alert firing, pending and silent). scripts/setup.sh puts promtool in the venv."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .test_chart import objects

HERE = Path(__file__).resolve().parent
TESTS = HERE / "alerts_test.yaml"


def promtool() -> str:
    found = shutil.which("promtool") or shutil.which("promtool", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("promtool not found: scripts/setup.sh unpacks it into the venv from Debian's prometheus package")
    return found


@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory) -> Path:
    (rule,) = [o for o in objects({"prometheusRule": {"enabled": True}}) if o["kind"] == "PrometheusRule"]
    out = tmp_path_factory.mktemp("alerts")
    (out / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    shutil.copy(TESTS, out / "alerts_test.yaml")
    return out


def alert_names(rules_dir: Path) -> set[str]:
    groups = yaml.safe_load((rules_dir / "rules.yaml").read_text())["groups"]
    return {r["alert"] for g in groups for r in g["rules"]}


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_check_rules(rules_dir):
    result = run("check", "rules", "rules.yaml", cwd=rules_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_names(rules_dir))} rules found" in result.stdout + result.stderr


def test_every_alert_is_tested_firing_and_silent(rules_dir):
    cases = [c for t in yaml.safe_load(TESTS.read_text())["tests"] for c in t["alert_rule_test"]]
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    silent = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert firing == alert_names(rules_dir)
    assert silent == alert_names(rules_dir)


def test_promtool_test_rules(rules_dir):
    result = run("test", "rules", "alerts_test.yaml", cwd=rules_dir)
    assert result.returncode == 0, result.stdout + result.stderr
