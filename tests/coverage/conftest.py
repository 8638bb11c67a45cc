"""Print what the parity tests measured (how many compute ops Gems actually served) in the run's summary.

The numbers travel from the test (``record_property``) through the report, so this works under xdist too.
"""
_SERVED = {}


def pytest_runtest_logreport(report):
    if report.when != "call":
        return
    props = dict(report.user_properties)
    if "parity_summary" in props:
        _SERVED[report.nodeid] = props["parity_summary"]


def pytest_terminal_summary(terminalreporter):
    if not _SERVED:
        return
    terminalreporter.write_sep("-", "gems-coverage parity (tiny models, Gems through the interpreter)")
    for nodeid in sorted(_SERVED):
        terminalreporter.write_line(_SERVED[nodeid])
