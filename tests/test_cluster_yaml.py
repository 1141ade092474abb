"""cluster.yaml validates against the schema shipped in the ray package, and keeps our promises."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import ray
import yaml

ROOT = Path(__file__).parents[1]


def _config() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_cluster_yaml_validates_against_rays_schema():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(_config(), schema)


def test_schema_check_has_teeth():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    broken = _config()
    broken["available_node_types"]["gpu_worker"]["resources"]["GPU"] = 0.5  # resources must be integers
    try:
        jsonschema.validate(broken, schema)
    except jsonschema.ValidationError:
        return
    raise AssertionError("a fractional GPU resource passed validation")


def test_gpu_batch_cluster_shape():
    config = _config()
    assert config["provider"]["type"] == "aws"
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}  # the head runs the driver, never a worker
    workers = [t for name, t in config["available_node_types"].items() if name != config["head_node_type"]]
    assert workers and all(t["resources"].get("GPU", 0) >= 1 for t in workers)
    assert all(t["min_workers"] == 0 and t["max_workers"] > 0 for t in workers)
    assert all(t["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot" for t in workers)
    assert config["idle_timeout_minutes"] > 0
    assert "gpu" in config["docker"]["image"]
    assert any("pip install" in c and "hybridgen" in c for c in config["setup_commands"])


def test_dashboard_bound_to_localhost():
    head_start = " ".join(_config()["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start


def _commented_node_type(name: str) -> dict:
    """The node type `name` that cluster.yaml carries commented out, uncommented and parsed."""
    lines = (ROOT / "cluster.yaml").read_text().splitlines()
    start = lines.index(f"  # {name}:")
    block = []
    for line in lines[start:]:
        if not line.startswith("  #"):
            break
        block.append(line.removeprefix("  #").removeprefix(" "))
    return yaml.safe_load("\n".join(block))[name]


def test_the_commented_multi_gpu_node_type_parses_and_validates():
    node_type = _commented_node_type("gpu_worker_8xh100")
    assert node_type["resources"] == {"CPU": 192, "GPU": 8}
    assert node_type["node_config"]["InstanceType"] == "p5.48xlarge"
    config = _config()
    config["available_node_types"]["gpu_worker_8xh100"] = node_type  # what uncommenting it gives
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    test_dashboard_bound_to_localhost()
