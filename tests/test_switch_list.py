"""The switch list in product_key_memory_ops.py's docstring, the one place the switches of the memory's paths and
checks are documented: it names every switch with its default, and fits 120 columns."""

from modeling_pkm_bert import product_key_memory_ops
from modeling_pkm_bert.modeling_bert_pkm import BertPkmModel
from modeling_pkm_bert.product_key_memory import ProductKeyMemory, ProductKeyValues


def switches() -> dict[str, object]:
    """Every switch by the name the list gives it, with its default: the public bool/tuple class attributes of the
    memory, its value table and the model (the fast paths, the input checks), and the module's upper-case flags."""
    found = {
        f"{cls.__name__}.{name}": value
        for cls in (ProductKeyMemory, ProductKeyValues, BertPkmModel)
        for name, value in vars(cls).items()
        if not name.startswith("_") and isinstance(value, (bool, tuple))
    }
    found.update(  # the flags and the size thresholds of the paths (OPS_VERSION names the custom ops: not a switch)
        (name, value)
        for name, value in vars(product_key_memory_ops).items()
        if name.isupper() and isinstance(value, (bool, int)) and name != "OPS_VERSION"
    )
    return found


def test_the_switch_list_names_every_switch_with_its_default():
    listing = product_key_memory_ops.__doc__
    assert len(switches()) >= 10  # the discovery finds the fast paths, their size thresholds and the input check
    for name, default in switches().items():
        assert f"`{name} = {default!r}`" in listing, f"{name} (default {default!r}) is missing from the switch list"
    assert "`PKM_BERT_NATIVE=0`" in listing  # the environment variable that keeps the native CPU selection off
    assert "_check_batch_statistics" in listing  # the memory's own input check: says that it has no switch


def test_the_switch_list_fits_120_columns():
    too_wide = [line for line in product_key_memory_ops.__doc__.splitlines() if len(line) > 120]
    assert not too_wide, f"{len(too_wide)} line(s) of the switch list over 120 columns: {too_wide[0][:60]}..."
