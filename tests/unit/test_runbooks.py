"""Every alert's runbook link lands on a heading of its own: the annotation names a page of this
repository and an anchor that GitHub makes from one of that page's headings."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"


def github_slug(heading: str, seen: dict[str, int]) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens, and
    -1, -2, ... on repeats."""
    text = re.sub(r"`|\*\*|__", "", heading.strip().lower())
    slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    return slug if count == 0 else f"{slug}-{count}"


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            found.add(github_slug(m.group(1), seen))
    return found


def alerts() -> list[dict[str, object]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_slugs_follow_github() -> None:
    seen: dict[str, int] = {}
    assert github_slug("`HighErrorRate`", seen) == "higherrorrate"
    assert github_slug("Redis: sizing, retention, backup", seen) == "redis-sizing-retention-backup"
    assert github_slug("Redis: sizing, retention, backup", seen) == "redis-sizing-retention-backup-1"


def test_every_alert_links_a_runbook_heading_that_exists() -> None:
    rules = alerts()
    assert rules
    for rule in rules:
        annotations = rule["annotations"]
        assert isinstance(annotations, dict)
        link = annotations.get("runbook_url") or annotations.get("runbook")
        assert link, f"{rule['alert']} has no runbook annotation"
        path, _, anchor = str(link).partition("#")
        page = ROOT / path
        assert page.is_file(), f"{rule['alert']}: {path} is not in the repository"
        assert anchor in anchors(page), f"{rule['alert']}: no heading of {path} makes the anchor #{anchor}"
        assert anchor == str(rule["alert"]).lower(), f"{rule['alert']}: one heading per alert, named after it"
