"""Every public name has a docstring: what ``vllm_lens.__all__``, the clients, the datasets
reader, the SAE helpers, the sinks' flush, the command line and the Inspect provider export,
and the public methods of the classes among them."""

import importlib
import re
import inspect

import pytest

MODULES = ("vllm_lens", "vllm_lens.client", "vllm_lens.datasets", "vllm_lens.saes",
           "vllm_lens.activations", "vllm_lens.attention", "vllm_lens.frontend.sink_control",
           "vllm_lens.cli.main", "inspect_provider")


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


def _own_doc(obj) -> str:
    """``obj``'s own docstring, cleaned (``inspect.getdoc`` would inherit a base class's or
    an overridden method's, hiding a name that has none of its own)."""
    doc = (obj.fget if isinstance(obj, property) else obj).__doc__
    return inspect.cleandoc(doc) if doc else ""


@pytest.mark.parametrize("module_name", MODULES)
def test_every_public_name_has_a_docstring(module_name):
    found = list(_public(module_name))
    assert found or module_name == "vllm_lens.cli.main"
    missing = [name for name, obj in found if not _own_doc(obj).strip()]
    assert not missing, f"public names without a docstring: {missing}"


def _top_level(module_name):
    """The functions and classes a module exports (``__all__``), without their methods."""
    module = importlib.import_module(module_name)
    for name in getattr(module, "__all__", ()):
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            yield f"{module_name}.{name}", obj


def _section(doc, *titles):
    """The lines of the first Google-style section of ``doc`` titled one of ``titles``
    (``"Args"``, ``"Examples"`` ...), or ``None`` when there is none."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.rstrip() in [f"{title}:" for title in titles]:
            body = []
            for rest in lines[i + 1:]:
                if rest.strip() and not rest.startswith(" "):
                    break  # the next section (inspect.getdoc removed the common indent)
                body.append(rest)
            return body
    return None


def _named_parameters(obj):
    """The parameters a caller names (not ``self`` / ``cls``, not ``*args`` / ``**kwargs``
    alone); ``[]`` when Python cannot tell (an exception class without an ``__init__``)."""
    if isinstance(obj, property):
        return []
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
             inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in signature.parameters.values()
            if p.kind in plain and p.name not in ("self", "cls")]


@pytest.mark.parametrize("module_name", MODULES)
def test_every_top_level_public_name_has_an_example(module_name):
    """Issue 31: each exported function and class shows a short ``>>>`` example (run by
    ``tests/integration/test_docstring_examples.py``), in an ``Examples:`` section: the API
    reference (griffe, Google style) renders that one as code, but ``Example:`` as an
    admonition whose ``>>>`` lines Markdown turns into nested quotes."""
    missing = [name for name, obj in _top_level(module_name)
               if not any(">>>" in line
                          for line in _section(_own_doc(obj), "Examples") or ())]
    assert not missing, ("public names without an 'Examples:' section (plural: 'Example:' "
                         f"renders as an admonition, not code) holding >>>: {missing}")


def _mirrors(doc: str) -> bool:
    """Whether a docstring opens by pointing to the method it mirrors (``AsyncLensClient``'s
    methods take the same arguments as ``LensClient``'s, documented there)."""
    return re.match(r"See `LensClient\.\w+`", doc) is not None


@pytest.mark.parametrize("module_name", MODULES)
def test_every_public_callable_with_parameters_documents_them(module_name):
    """Issue 31: a public function, class or method that takes arguments has ``Args:`` (or
    ``Keyword Args:``, for keyword-only constructors the API reference cannot see, such as
    a pydantic model's)."""
    missing = [name for name, obj in _public(module_name) if _named_parameters(obj)
               and _section(_own_doc(obj), "Args", "Keyword Args") is None
               and not _mirrors(_own_doc(obj))]
    assert not missing, f"public callables with parameters but no Args: section: {missing}"
