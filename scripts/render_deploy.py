"""Render the Kubernetes work-pool files: for your cluster into .goodput/kubernetes/, or
(--template) the committed examples under deploy/kubernetes/.

    python scripts/render_deploy.py --image registry.example.com/goodput:1.2 \\
        --namespace ml --gpus 8 --gpu-node-label cloud.google.com/gke-accelerator=nvidia-h100-80gb
    python scripts/render_deploy.py --template           # refresh deploy/kubernetes/

Every run writes all three files from the options it is given (defaults for the others):
give every option you need in one command. An image is required: without --template, the
placeholder image (ghcr.io/example/...) is refused, since a pool deployed with it would
start pods that cannot pull their image.

- base-job-template.json: Prefect's own Kubernetes base job template (the one bundled with
  the installed Prefect, so it matches the worker's version) plus what a GPU node pool
  needs: `gpus` (nvidia.com/gpu limit), `node_selector`, `tolerations`, and a
  memory-backed /dev/shm of `shm_size` (NCCL and data loaders outgrow the 64 MB default),
  and the run's shared volume (`shared_volume`, mounted by `shared_volume_mount`): the
  claim that launch.kubernetes.volume_claim names, at its mount_path, where the flow and
  the training pods it starts both see the run directories and the dataset. Every addition
  is optional: unset, it disappears from the rendered Job.
- job-variables.json: the orchestrating pod on ordinary nodes (prepare, evaluate, and the
  flow that launches a multi-node training job through infra/'s Kubernetes launcher).
- job-variables-gpu.json: a train flow run that runs torchrun itself, on one GPU node.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import prefect

REPO = Path(__file__).resolve().parents[1]
TEMPLATE_DIR = REPO / "deploy" / "kubernetes"  # committed: rendered with --template
RENDER_DIR = REPO / ".goodput" / "kubernetes"  # a cluster's own render (not committed)
PLACEHOLDER_REGISTRY = "ghcr.io/example/"  # the examples' image lives nowhere
PLACEHOLDER_IMAGE = f"{PLACEHOLDER_REGISTRY}goodput:latest"
PREFECT_METADATA = (Path(prefect.__file__).parent / "server" / "api" / "collections_data"
                    / "views" / "aggregate-worker-metadata.json")

GPU_VARIABLES = {
    "gpus": {"title": "GPUs", "type": "integer", "minimum": 1,
             "description": "nvidia.com/gpu limit of the flow run's container; unset: no GPU."},
    "node_selector": {"title": "Node Selector", "type": "object",
                      "additionalProperties": {"type": "string"},
                      "description": "Node labels the pod must match, e.g. the GPU node pool's."},
    "tolerations": {"title": "Tolerations", "type": "array", "items": {"type": "object"},
                    "description": "Taints the pod tolerates (GPU pools are usually tainted)."},
    "shm_size": {"title": "Shared Memory Size", "type": "string",
                 "description": "Size of a memory-backed /dev/shm, e.g. '64Gi'; unset: the "
                                "container runtime's default (64 MB)."},
    "shared_volume": {"title": "Shared Volume", "type": "object",
                      "description": "The pod volume holding runs and data, e.g. {\"name\": "
                                     "\"shared\", \"persistentVolumeClaim\": {\"claimName\": "
                                     "\"goodput-shared\"}}: launch.kubernetes.volume_claim's claim."},
    "shared_volume_mount": {"title": "Shared Volume Mount", "type": "object",
                            "description": "Where the container mounts it, e.g. {\"name\": "
                                           "\"shared\", \"mountPath\": \"/goodput\"}: "
                                           "launch.kubernetes.mount_path."},
}


def base_job_template() -> dict:
    """Prefect's Kubernetes template with the GPU node pool variables wired into the Job."""
    metadata = json.loads(PREFECT_METADATA.read_text())
    template = copy.deepcopy(
        metadata["prefect-kubernetes"]["kubernetes"]["default_base_job_configuration"])
    template["variables"]["properties"].update(GPU_VARIABLES)
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    pod["nodeSelector"] = "{{ node_selector }}"
    pod["tolerations"] = "{{ tolerations }}"
    # Prefect's templating drops a list item that is a placeholder alone whose variable is
    # unset: without shared_volume the pod has /dev/shm only.
    pod["volumes"] = [{"name": "dshm",
                       "emptyDir": {"medium": "Memory", "sizeLimit": "{{ shm_size }}"}},
                      "{{ shared_volume }}"]
    container = pod["containers"][0]
    container["resources"]["limits"]["nvidia.com/gpu"] = "{{ gpus }}"
    container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"},
                                 "{{ shared_volume_mount }}"]
    return template


def job_variables(args: argparse.Namespace) -> dict:
    shared = {}
    if args.volume_claim:  # the flow's pod sees what the training pods write
        shared = {"shared_volume": {"name": "shared",
                                    "persistentVolumeClaim": {"claimName": args.volume_claim}},
                  "shared_volume_mount": {"name": "shared", "mountPath": args.mount_path}}
    return {
        "image": args.image,
        "namespace": args.namespace,
        "service_account_name": "goodput",
        "image_pull_policy": "IfNotPresent",
        "env": {"GOODPUT_REPO": "/opt/goodput", "TOKENIZERS_PARALLELISM": "false",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
        "cpu_request": "2",
        "memory_request": "8Gi",
        "finished_job_ttl": 3600,
        **shared,
    }


def gpu_job_variables(args: argparse.Namespace) -> dict:
    key, value = args.gpu_node_label.split("=", 1)
    variables = job_variables(args)
    variables["env"] = {**variables["env"], "NCCL_DEBUG": "WARN",
                        "OMP_NUM_THREADS": str(max(1, args.cpus // args.gpus))}
    variables.update({
        "gpus": args.gpus,
        "node_selector": {key: value},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "shm_size": args.shm_size,
        "cpu_request": str(args.cpus),
        "memory_request": args.memory,
    })
    return variables


def render(args: argparse.Namespace) -> dict[str, dict]:
    return {"base-job-template.json": base_job_template(),
            "job-variables.json": job_variables(args),
            "job-variables-gpu.json": gpu_job_variables(args)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write the files (default: {RENDER_DIR.relative_to(REPO)}, "
                             f"or {TEMPLATE_DIR.relative_to(REPO)} with --template)")
    parser.add_argument("--image", default=None,
                        help="an image with the repository at /opt/goodput and its .venv "
                             "(required unless --template)")
    parser.add_argument("--template", action="store_true",
                        help=f"render the committed examples: image {PLACEHOLDER_IMAGE} unless "
                             f"--image is given, into {TEMPLATE_DIR.relative_to(REPO)}")
    parser.add_argument("--namespace", default="goodput")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per GPU-pool node")
    parser.add_argument("--cpus", type=int, default=64, help="CPU request of a GPU pod")
    parser.add_argument("--memory", default="512Gi", help="memory request of a GPU pod")
    parser.add_argument("--shm-size", default="64Gi")
    parser.add_argument("--volume-claim", default="goodput-shared",
                        help="ReadWriteMany claim holding runs and data, as "
                             "launch.kubernetes.volume_claim ('' for none)")
    parser.add_argument("--mount-path", default="/goodput",
                        help="where pods mount it, as launch.kubernetes.mount_path")
    parser.add_argument("--gpu-node-label", default="goodput.dev/pool=gpu",
                        help="KEY=VALUE label of the GPU node pool's nodes")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.template:
        args.image = args.image or PLACEHOLDER_IMAGE
        args.out = args.out or TEMPLATE_DIR
    else:
        if not args.image or args.image.startswith(PLACEHOLDER_REGISTRY):
            parser.error(f"--image {args.image or '(not given)'}: give the image your cluster "
                         "pulls (this repository at /opt/goodput with its .venv), e.g. --image "
                         "registry.example.com/goodput:1.0; --template renders the committed "
                         f"examples with the placeholder {PLACEHOLDER_IMAGE}")
        args.out = args.out or RENDER_DIR
    args.out.mkdir(parents=True, exist_ok=True)
    for name, content in render(args).items():
        (args.out / name).write_text(json.dumps(content, indent=2) + "\n")
        print(args.out / name)


if __name__ == "__main__":
    main()
