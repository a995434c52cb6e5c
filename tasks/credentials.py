"""Credentials the Prefect way: blocks, so that a run triggered from the UI on a work pool
needs no environment variables.

- `storage.credentials_block`: a prefect-aws `AwsCredentials` block (keys, session token,
  profile or role to assume, region, endpoint in its client parameters);
- `tracking.wandb_api_key_block`: a `Secret` block holding the W&B API key.

They are loaded in the flow run's process into the variables the standard chains read
(AWS_*, WANDB_API_KEY): the store this process opens, the verifier and evaluation processes
it starts and the training workers on local and Slurm nodes (sbatch passes its environment
on) all find them there, and none of them changes. The values never reach a file, a log, an
artifact or an event: the config holds the blocks' names, the task returns only which
variables it set. Nodes started over ssh or on Kubernetes read the store with their own
credentials (their environment or instance role): the values are not sent to them.
"""

from __future__ import annotations

import os

from prefect import task
from prefect.cache_policies import NO_CACHE

from core.config import ConfigError, RunConfig
from tasks.train import retry_unless_config_error

# What a block replaces: a value of the caller's left beside the block's would mix two
# identities (say its session token with the block's keys).
AWS_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


def _load(block_type, name: str, field: str):
    try:
        return block_type.load(name)
    except ValueError as e:  # Prefect: "Unable to find block document named ..."
        raise ConfigError(f"{field}={name!r}: no {block_type.__name__} block of that name on "
                          f"this Prefect server ({e}); create it (README, 'Credentials') or "
                          f"unset {field}") from None


def aws_environment(block) -> dict[str, str]:
    """The AWS variables of an AwsCredentials block, through the session it makes (so a
    profile or a role to assume works too)."""
    session = block.get_boto3_session()
    frozen = session.get_credentials()
    if frozen is None:
        raise ConfigError("storage.credentials_block: the block yields no AWS credentials "
                          "(no keys, and its profile or role gives none)")
    frozen = frozen.get_frozen_credentials()
    env = {"AWS_ACCESS_KEY_ID": frozen.access_key, "AWS_SECRET_ACCESS_KEY": frozen.secret_key}
    if frozen.token:
        env["AWS_SESSION_TOKEN"] = frozen.token
    if session.region_name:
        env["AWS_DEFAULT_REGION"] = session.region_name
    endpoint = block.aws_client_parameters.endpoint_url
    if endpoint:
        env["AWS_ENDPOINT_URL"] = env["AWS_ENDPOINT_URL_S3"] = str(endpoint)
    return env


@task(name="load-credentials", cache_policy=NO_CACHE, persist_result=False, retries=2,
      retry_delay_seconds=2, retry_condition_fn=retry_unless_config_error)
def load_credentials(config: RunConfig) -> list[str]:
    """Set this process's AWS and W&B variables from the config's blocks; returns the
    variables' names (never their values)."""
    env: dict[str, str] = {}
    if config.storage.credentials_block:
        from prefect_aws import AwsCredentials

        env.update(aws_environment(_load(AwsCredentials, config.storage.credentials_block,
                                         "storage.credentials_block")))
        for name in AWS_VARIABLES:
            os.environ.pop(name, None)
    if config.tracking.wandb_api_key_block:
        from prefect.blocks.system import Secret

        env["WANDB_API_KEY"] = str(_load(Secret, config.tracking.wandb_api_key_block,
                                         "tracking.wandb_api_key_block").get())
    os.environ.update(env)
    return sorted(env)


def uses_blocks(config: RunConfig) -> bool:
    return bool(config.storage.credentials_block or config.tracking.wandb_api_key_block)
