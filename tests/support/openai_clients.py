"""The fixtures both OpenAI client test modules use, over the one mesh they share (``openai_mesh``).

A module takes them with ``from tests.support.openai_clients import client, head, mesh, model_dir``.
"""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def mesh(openai_mesh):
    """``(head, tail)``: the head answers to "tiny" and "tiny-alias"; the tail, to its folder's name (see
    ``tests.conftest.openai_mesh``)."""
    return openai_mesh


@pytest.fixture(scope="module")
def head(mesh):
    return mesh[0]


@pytest.fixture(scope="module")
def client(head):
    return openai.OpenAI(base_url=head.url + "/v1", api_key="none", _strict_response_validation=True,
                         max_retries=0, timeout=300)
