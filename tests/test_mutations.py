"""The mutation check's list stays true to the code: every mutation in tests/mutations.py still
finds the text it edits (exactly once), and names tests that exist. (Running the mutations takes
minutes: ``python tests/mutations.py``, in CI after the suite.)"""

from __future__ import annotations

from mutations import MUTATIONS, ROOT, check_applies


def test_every_mutation_applies_and_names_existing_tests():
    assert len(MUTATIONS) >= 10 and len({m.name for m in MUTATIONS}) == len(MUTATIONS)
    assert [problem for problem in map(check_applies, MUTATIONS) if problem] == []
    for test in {test for m in MUTATIONS for test in m.tests}:
        path, _, name = test.partition("::")
        source = (ROOT / path).read_text()
        name = name.partition("[")[0]  # a parametrized test's case: its function must exist
        assert not name or f"def {name}(" in source, f"{test}: no such test"
