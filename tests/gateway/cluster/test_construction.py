"""A Gateway is built with its Cluster: it uses the cluster's quotas, voices, engine and sessions
from the start (nothing is swapped afterwards), and the cluster's code never imports the app."""

from __future__ import annotations

from pathlib import Path

from gateway.app import Gateway, create_app
from gateway.cluster.quotas import SharedQuotas
from gateway.cluster.state import Cluster, DirectoryEngine
from gateway.cluster.voices import SharedVoiceRegistry
from gateway.config import GatewayConfig
from gateway.quotas import QuotaLimits, Quotas
from gateway.twilio import TwilioGateway
from gateway.voices import VoiceRegistry
from gateway.webhooks import WebhookSender
from tests.fakes import FakeEngine
from tests.house.test_architecture import ROOT, imports_of

UNUSED_URL = "redis://127.0.0.1:1/0"  # nothing connects while the objects are only built


def test_a_gateway_built_with_a_cluster_uses_its_parts() -> None:
    engine = FakeEngine()
    config = GatewayConfig(redis_url=UNUSED_URL, replica_id="r7", quota_limits=QuotaLimits(sessions=3))
    twilio = TwilioGateway(engine, config, WebhookSender.from_env())
    cluster = Cluster(engine, config, twilio)
    gateway = Gateway(engine, config, cluster=cluster)
    assert gateway.cluster is cluster
    assert gateway.quotas is cluster.quotas and isinstance(gateway.quotas, SharedQuotas)
    assert gateway.quotas.limits.sessions == 3 and gateway.quotas.replica_id == "r7"
    assert gateway.voices is cluster.voices and isinstance(gateway.voices, SharedVoiceRegistry)
    assert isinstance(gateway.engine, DirectoryEngine) and gateway.engine.inner is engine
    assert gateway.sessions is cluster.sessions
    assert cluster.calls is not None and twilio.router is cluster.calls
    assert b"cadence_store_breaker_state" in gateway.metrics.render()[0]  # the cluster's metrics too


def test_a_gateway_alone_keeps_everything_in_process() -> None:
    engine = FakeEngine()
    gateway = Gateway(engine, GatewayConfig())
    assert gateway.cluster is None and gateway.engine is engine
    assert type(gateway.quotas) is Quotas and type(gateway.voices) is VoiceRegistry
    app = create_app(engine, GatewayConfig())
    assert app.state.gateway.cluster is None


def test_create_app_builds_the_cluster_first() -> None:
    app = create_app(FakeEngine(), GatewayConfig(redis_url=UNUSED_URL, replica_id="r1"))
    gateway = app.state.gateway
    assert isinstance(gateway.cluster, Cluster) and gateway.quotas is gateway.cluster.quotas
    assert gateway.webhooks is app.state.twilio.webhooks


def test_the_cluster_never_imports_the_app() -> None:
    for path in sorted(Path(ROOT, "gateway", "cluster").glob("*.py")):
        module = f"gateway.cluster.{path.stem}"
        imported = imports_of(path.read_text(encoding="utf-8"), module)
        assert not {name for name in imported if name == "gateway.app" or name.startswith("gateway.app.")}, (
            module
        )
