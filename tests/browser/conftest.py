"""The browser tests run on the integration tests' topology and processor fixtures."""

from tests.integration.conftest import client, processor_factory, running_processor, topology  # noqa: F401
