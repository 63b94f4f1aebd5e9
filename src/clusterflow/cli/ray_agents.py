"""``clusterflow ray-agents``: start, show and stop the per-node agents of a Ray cluster.

Parsing and printing only; the work is ``clusterflow.backends.ray_agent``. With agents
started, ``start --backend ray`` launches each task through its node's agent instead of
a fresh Ray worker (docs/ray.md, "Launch time"). Errors (Ray unreachable, a busy agent
without ``--force``) are one ``error:`` line and exit code 2, printed by ``cli.main``.
"""

from __future__ import annotations

import click

from clusterflow.cli.context import CONTEXT

ADDRESS_HELP = "The Ray cluster's HOST:PORT [default: RAY_ADDRESS, or auto]."


@click.group(name="ray-agents", context_settings=CONTEXT)
def ray_agents() -> None:
    """One long-lived clusterflow agent per Ray node: launches start no Ray worker."""


@ray_agents.command(context_settings=CONTEXT)
@click.option("--address", help=ADDRESS_HELP)
def start(address: str | None) -> None:
    """Enables agents on the Ray cluster and starts one on every live node (nodes that
    join later get theirs at their first launch; a crashed one is replaced)."""
    import ray

    from clusterflow.backends import ray_agent, ray_driver
    from clusterflow.manager import agent_record

    ray_driver.join(address)
    for info in ray_agent.start_all():
        click.echo(f"agent on node {info['node_id']} (pid {info['pid']})")
    port = ray_agent.head_port()
    if port is not None:
        # Named as given and as Ray resolved it (`auto`, RAY_ADDRESS): a launch naming
        # either reaches the head's agent without joining Ray (docs/ray.md, "Agents").
        for named in {agent_record.address_of(address), ray.get_runtime_context().gcs_address}:
            agent_record.write(named, port)
        click.echo(f"agent port {port['address']} (recorded in {agent_record.path(address)})")


@ray_agents.command(context_settings=CONTEXT)
@click.option("--address", help=ADDRESS_HELP)
def status(address: str | None) -> None:
    """Every agent of the Ray cluster and the tasks it hosts, and the head agent's port
    as recorded here (whether it answers: a launch uses it only then)."""
    from clusterflow.backends import ray_agent, ray_driver
    from clusterflow.manager import agent_record

    ray_driver.join(address)
    click.echo(agent_record.describe(address))
    click.echo(f"agents {'enabled' if ray_agent.enabled() else 'disabled'}")
    for info in ray_agent.running():
        if "error" in info:
            click.echo(f"agent on node {info['node_id']}: {info['error']}")
            continue
        hosted = ", ".join(info["hosted"]) or "no tasks"
        click.echo(f"agent on node {info['node_id']} (pid {info['pid']}): {hosted}")


@ray_agents.command(context_settings=CONTEXT)
@click.option("--address", help=ADDRESS_HELP)
@click.option("--force", is_flag=True, help="Stop agents even while they host tasks (killed).")
def stop(address: str | None, force: bool) -> None:
    """Disables agents on the Ray cluster and ends every agent (`ray stop` ends them too)."""
    from clusterflow.backends import ray_agent, ray_driver
    from clusterflow.manager import agent_record

    ray_driver.join(address)
    nodes = ray_agent.stop_all(force=force)
    agent_record.remove(address)
    click.echo(f"stopped {len(nodes)} agent(s)")
