"""Programs per input shapes and mode (autopar.runtime.variants.Variants): built once per key, the
compiled one always kept, the others bounded, least recently used dropped first."""

from autopar.runtime.variants import Variants


def test_each_key_is_built_once_and_the_least_recently_used_is_dropped():
    built = []

    def build(key):
        def make():
            built.append(key)
            return f"program {key}"
        return make

    cache = Variants("compiled", "program compiled", limit=2)
    assert cache.get("compiled", build("compiled")) == "program compiled"
    assert cache.get("a", build("a")) == "program a"
    assert cache.get("b", build("b")) == "program b"
    assert cache.get("a", build("a")) == "program a"  # kept: not built again, now the most recent
    assert cache.get("c", build("c")) == "program c"  # over the limit: "b", the least recent, goes
    assert len(cache) == 3
    cache.get("a", build("a"))
    cache.get("b", build("b"))  # built again
    assert built == ["a", "b", "c", "b"]
    for key in "defgh":  # a loop over ever new shapes never drops the compiled program
        cache.get(key, build(key))
    assert cache.get("compiled", build("compiled")) == "program compiled"
    assert len(cache) == 3 and "compiled" not in built
