"""The store contract against the in-memory and local-file stores."""

from __future__ import annotations

from pathlib import Path

import pytest

from dbtrigger import FileCheckpointStore, InMemoryCheckpointStore
from tests.contracts.store_contract import StoreContract


class TestInMemoryStore(StoreContract):
    @pytest.fixture
    def store(self) -> InMemoryCheckpointStore:
        return InMemoryCheckpointStore()


class TestFileStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> FileCheckpointStore:
        return FileCheckpointStore(tmp_path / "state")
