"""Fakes the edge's unit tests share (no Ray): the OpenAI server's request path on an
instance built around a runtime of the test's own, with no replica, no runtime start and
no metrics. Import them (``from tests.serve.fakes import edge_server``)."""

import deploy.serve_app as serve_app
from deploy import openai_api as api
from core.response_store import ResponseStore
from deploy.settings import AppSettings

# the server class itself, under Ray Serve's deployment wrapper
SERVER = getattr(serve_app.OpenAIServer, "func_or_class", serve_app.OpenAIServer)


class NoMetrics:
    def request(self, *_a):
        pass

    def ttft(self, *_a):
        pass

    def tokens(self, *_a):
        pass


class _Server(SERVER):
    def __del__(self):  # Serve's ingress wrapper ends a replica's ASGI app here: none here
        pass


def edge_server(runtime, **settings):
    """A server instance whose requests go to ``runtime`` (``generate``, ``end_session``,
    what the test needs); ``settings`` are AppSettings fields."""
    inst = object.__new__(_Server)
    inst.settings = AppSettings(start_runtime=False, **settings)
    inst.limits = inst.settings.limits
    inst.runtime = runtime
    inst._models, inst._served, inst._metrics = ["m"], api.Served(), NoMetrics()
    inst._open_streams = 0
    s = inst.settings
    inst._stored = ResponseStore(s.responses_ttl_s, s.responses_max_stored,
                                 s.responses_max_stored_chars)
    return inst
