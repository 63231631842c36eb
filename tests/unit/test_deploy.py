"""The compose file must start processes that exist, configured by settings that exist."""

from pathlib import Path

import yaml
from typer.main import get_command

from app.cli import cli
from app.core.config import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_compose_services_run_real_commands_with_real_settings():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "api", "batcher", "stage0", "flower"} <= set(services)
    commands = set(get_command(cli).commands)  # type: ignore[attr-defined]
    fields = {name.upper() for name in Settings.model_fields}
    for name, service in services.items():
        command = service.get("command", [])
        if command and command[0] == "conveyor":
            assert command[1] in commands, f"{name}: unknown command {command[1]}"
        for var in service.get("environment", {}):
            if var.startswith("CONVEYOR_"):
                assert var.removeprefix("CONVEYOR_") in fields, f"{name}: unknown setting {var}"
    assert "--appendonly" in services["redis"]["command"]
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    assert "USER conveyor" in dockerfile and "torch==2.13.0" in dockerfile
