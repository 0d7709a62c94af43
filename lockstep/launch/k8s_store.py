"""An elastic Kubernetes job's rendezvous store in a pod of its own, behind a Service.

With the training operator's elasticPolicy, `<name>-worker-0` hosts torch's c10d store, and the job
cannot outlive that pod: the other workers re-form the group through the store, which is gone with
it. So by default an elastic job also gets a Job of one pod that runs `lockstep rendezvous`
(lockstep.launch.store: torch's TCPStore, nothing else) and a Service in front of it, and every
worker's torchrun joins the store there as a client, under the rendezvous id `<name>`. The store pod
runs no worker, so the job goes on after losing any worker pod, worker-0 included. It ends with the
training job (`--until-closed`: torch's agents close the rendezvous when the job finishes, and when
its workers have failed for good), and Kubernetes deletes it TTL_SECONDS later; agents stopped by a
signal leave the rendezvous open, and the store then serves on until it is deleted. `--rdzv-store
node0` keeps the operator's layout (one pod fewer; the job then ends with worker-0). A fixed-size
job meets in a static rendezvous and fails with any pod, so it has nothing to gain from a store of
its own. If the store pod itself is lost, the workers' next rendezvous fails: the job ends as it
does when worker-0 is lost in the operator's layout (README, "Kubernetes")."""

from __future__ import annotations

from kubernetes import client

STORE_PORT = 29400  # `lockstep rendezvous`'s default port
TTL_SECONDS = 600  # a finished store Job (and its pod) is deleted this long after it ends
STORES = ("node0", "external")


def store_name(job: str) -> str:
    return f"{job}-rendezvous"


def store_endpoint(job: str) -> str:
    """HOST:PORT of the store as the workers reach it: the Service's DNS name in their namespace."""
    return f"{store_name(job)}:{STORE_PORT}"


def build_store(
    job: str, namespace: str | None, image: str
) -> tuple[client.V1Service, client.V1Job]:
    """The Service, then the Job of the one pod that serves the store until the training job's
    rendezvous (its id: the job's name) closes, which its agents do when the job ends."""
    labels = {"app.kubernetes.io/name": "lockstep", "lockstep/rendezvous": job}
    meta = client.V1ObjectMeta(name=store_name(job), namespace=namespace, labels=labels)
    service = client.V1Service(
        api_version="v1",
        kind="Service",
        metadata=meta,
        spec=client.V1ServiceSpec(
            selector=labels,
            ports=[
                client.V1ServicePort(name="rendezvous", port=STORE_PORT, target_port=STORE_PORT)
            ],
        ),
    )
    serve = ["python", "-m", "lockstep", "rendezvous", "--port", str(STORE_PORT)]
    container = client.V1Container(
        name="rendezvous",
        image=image,
        command=[*serve, "--until-closed", job],
        ports=[client.V1ContainerPort(name="rendezvous", container_port=STORE_PORT)],
        # the Service sends the workers here once the store listens
        readiness_probe=client.V1Probe(
            tcp_socket=client.V1TCPSocketAction(port=STORE_PORT), period_seconds=2
        ),
        # a TCPStore and the interpreter that imports torch for it; limits equal to the requests
        # (Guaranteed): the last pod a node evicts
        resources=client.V1ResourceRequirements(
            requests={"cpu": "250m", "memory": "1Gi"}, limits={"cpu": "250m", "memory": "1Gi"}
        ),
    )
    store = client.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=meta,
        spec=client.V1JobSpec(
            # a store that fails starts again empty: the workers' next rendezvous then fails too
            backoff_limit=0,
            ttl_seconds_after_finished=TTL_SECONDS,
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(containers=[container], restart_policy="Never"),
            ),
        ),
    )
    return service, store
