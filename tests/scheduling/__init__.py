import pytest

# The shared scheduler contract lives outside a test_*.py module so pytest does not collect
# it twice; register it so its asserts still get pytest's detailed failure messages.
pytest.register_assert_rewrite("tests.scheduling.scheduler_contract")
