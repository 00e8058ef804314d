"""Every public name has a docstring: what ``vllm_lens.__all__``, the clients, the datasets
reader, the SAE helpers, the sinks' flush, the command line and the Inspect provider export,
and the public methods of the classes among them."""

import importlib
import inspect

import pytest

MODULES = ("vllm_lens", "vllm_lens.client", "vllm_lens.datasets", "vllm_lens.saes",
           "vllm_lens.activations", "vllm_lens.attention", "vllm_lens.sink_control",
           "vllm_lens.cli", "inspect_provider")


def _public(module_name):
    module = importlib.import_module(module_name)
    for name in getattr(module, "__all__", ()):
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or callable(obj)):
            continue  # constants are documented where they are defined
        yield f"{module_name}.{name}", obj
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                if not attr.startswith("_") and (callable(value) or isinstance(value, property)):
                    yield f"{module_name}.{name}.{attr}", value


@pytest.mark.parametrize("module_name", MODULES)
def test_every_public_name_has_a_docstring(module_name):
    found = list(_public(module_name))
    assert found or module_name == "vllm_lens.cli"
    missing = [name for name, obj in found if not (inspect.getdoc(obj) or "").strip()]
    assert not missing, f"public names without a docstring: {missing}"
