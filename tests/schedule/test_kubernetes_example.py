"""examples/kubernetes/workers-job.yaml: a Job Kubernetes accepts (``kubectl apply --dry-run=client`` where a
cluster answers), and in any case the fields a worker Job needs, the password only from a Secret."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.engine import make_url

MANIFEST = Path(__file__).resolve().parents[2] / "examples" / "kubernetes" / "workers-job.yaml"
NO_CLUSTER = ("connection refused", "unable to recognize", "no configuration has been provided", "couldn't get current server")


def _job() -> dict[str, Any]:
    documents = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    assert len(documents) == 1
    return documents[0]


def test_kubectl_accepts_the_manifest_where_a_cluster_answers() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl: the schema check below stands alone")
    done = subprocess.run([kubectl, "apply", "--dry-run=client", "-f", str(MANIFEST)], capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0 and any(s in done.stderr.lower() for s in NO_CLUSTER):
        pytest.skip("no cluster answers (a client dry-run still asks the API server for its schema)")
    assert done.returncode == 0, done.stderr
    assert "job.batch/autofit-workers-h100 created (dry run)" in done.stdout


def test_the_job_has_what_a_worker_job_needs_and_the_password_only_from_a_secret() -> None:
    job = _job()
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job") and job["metadata"]["name"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] >= spec["parallelism"] >= 1
    assert spec["backoffLimit"] >= 6  # restarts while the database comes back do not fail the Job
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure"  # a Job allows OnFailure or Never; this one restarts in place
    volumes = {v["name"]: v for v in pod["volumes"]}
    (container,) = pod["containers"]
    assert container["name"] and container["image"]
    command = container["command"]
    assert command[:2] == ["autofit", "worker"] and "--storage" not in command and "--entry-root" in command
    assert "--hardware" in command and command[command.index("--hardware") + 1] != "auto"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert set(mounts.values()) <= set(volumes)
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]
    env = {e["name"]: e for e in container["env"]}
    assert make_url(env["AUTOFIT_STORAGE"]["value"]).password is None
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "autofit-db", "key": "password"}
    assert "value" not in env["PGPASSWORD"]
    for variable in container["env"]:  # no literal secret anywhere
        assert "value" not in variable or "password" not in variable["name"].lower()
