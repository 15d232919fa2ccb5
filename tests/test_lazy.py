import sys
import types

from fpbench.lazy import LazyModule


def test_first_read_imports_the_module_and_rebinds_fpbench_modules(monkeypatch):
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    stand_in = LazyModule("colorsys")
    holder = types.ModuleType("fpbench._lazy_holder")  # an fpbench module that imported it
    holder.colorsys = stand_in
    outsider = types.ModuleType("elsewhere")  # a module outside fpbench keeps the stand-in
    outsider.colorsys = stand_in
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    monkeypatch.setitem(sys.modules, outsider.__name__, outsider)
    assert "colorsys" not in sys.modules

    assert stand_in.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)  # read through the stand-in
    assert holder.colorsys is sys.modules["colorsys"]
    assert outsider.colorsys is stand_in
    assert stand_in.hsv_to_rgb(0.0, 1.0, 1.0) == (1.0, 0.0, 0.0)  # still forwards
