"""The loopback endpoint's Host / Origin check through Ray Serve's real proxy (it must see
the connection's local address and the headers the browser sent): the openai client is
served, a rebound DNS name and a web page's Origin are refused. Tiny random-weight model."""


import httpx2 as httpx
import openai
import pytest

from cluster.config import ClusterConfig
from cluster.launch import free_port
from deploy import service

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def svc(tiny_model_dir, shared_ray):
    config = ClusterConfig(num_workers=1, model=str(tiny_model_dir),
                           worker={"num_cpus": 1, "num_threads": 1},
                           engine={"num_kv_blocks": 64})
    with shared_ray():
        yield service.start(config, port=free_port())  # loopback, no API key


def test_loopback_clients_are_served_and_web_pages_are_not(svc):
    client = openai.OpenAI(base_url=svc.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    assert client.models.list().data
    out = client.chat.completions.create(model=client.models.list().data[0].id,
                                         messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=2)
    assert out.choices[0].message is not None
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    port = svc.url.rsplit(":", 1)[1]
    rebound = httpx.post(svc.url + "/v1/chat/completions", json=body, timeout=60,
                         headers={"Host": f"attacker.example:{port}"})
    assert rebound.status_code == 421 and rebound.json()["error"]["code"] == "invalid_host"
    page = httpx.post(svc.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Origin": "https://attacker.example"})
    assert page.status_code == 403
    assert httpx.get(svc.url + "/v1/models", timeout=60,
                     headers={"Origin": "http://localhost:3000"}).status_code == 200
