"""The GPU's limits as the driver reports them (:mod:`mqa_byoc.runtime.gpu_limits`): this GPU's name is in
the data sheet's table, and the bandwidth derived from its memory clock and bus width agrees with the table."""

from __future__ import annotations

import pytest

import gpu_common


@pytest.fixture(scope="module")
def props():
    reason = gpu_common.skip_reason()
    if reason:
        pytest.skip(reason)
    from mqa_byoc.runtime.gpu_limits import driver_properties

    return driver_properties(0)


def test_this_gpu_has_data_sheet_limits_that_the_driver_figures_confirm(props):
    import torch

    from mqa_byoc.runtime.gpu_limits import derived_limits, device_limits, limits_for

    assert props["name"] == torch.cuda.get_device_name(0)
    sheet = limits_for(props["name"])
    assert sheet is not None, f"{props['name']} is not in the data-sheet table"
    assert device_limits() == sheet
    derived = derived_limits(props)
    assert derived is not None, f"the driver reports {props}"
    assert derived.hbm_tbps == pytest.approx(sheet.hbm_tbps, rel=0.05), (props, sheet)
    # the driver's clock is the boost clock: the data sheet's rate lies at or below it
    assert 0.85 * derived.dense_tflops <= sheet.dense_tflops <= 1.01 * derived.dense_tflops, (props, sheet)
