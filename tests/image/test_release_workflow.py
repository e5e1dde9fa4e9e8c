"""The release workflow (which cannot run here) builds with the script CI runs."""

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_release_builds_both_flavours_with_the_ci_build_script():
    workflow = yaml.safe_load((REPO / ".github/workflows/release.yml").read_text())
    image = workflow["jobs"]["image"]
    assert image["strategy"]["matrix"]["flavour"] == ["cpu", "gpu"]
    builds = [s["run"] for s in image["steps"] if "scripts/build_image.sh" in s.get("run", "")]
    assert builds == ['sudo -E bash scripts/build_image.sh --flavour "${{ matrix.flavour }}" '
                      '--tag "localhost/splitserve:release"']
    chart = "\n".join(s.get("run", "") for s in workflow["jobs"]["chart"]["steps"])
    assert "helm package charts/splitserve" in chart and "helm push" in chart
