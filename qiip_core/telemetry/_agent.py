"""The telemetry agent's loop: read NVML every interval and publish the reading.

The agent never stops for want of a GPU: a host without NVML (no driver library, no driver loaded) is reported
once, in one log line, and nothing is published; NVML is tried again at each interval, so an agent started before
the driver (at boot, during provisioning) begins publishing by itself once the driver is there. A failed reading
or a failed publish is logged when it starts and when it ends, never at every interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from qiip_core._errors import RegistryUnavailable
from qiip_core.telemetry._nvml import NvmlReader, NvmlUnavailable, TelemetryError
from qiip_core.telemetry._publish import Publisher
from qiip_core.telemetry._types import NodeTelemetry

__all__ = ["TelemetryAgent"]

logger = logging.getLogger("qiip.telemetry")


class TelemetryAgent:
    """Reads this host's GPUs every `interval_s` and hands each reading to a publisher.

    Args:
        publisher: where readings go (`EtcdPublisher`, `HttpPublisher`).
        node_id: the node the readings belong to.
        hostname: this host's name.
        interval_s: seconds between two readings.
        reader: the NVML reader; None reads the real NVML.
    """

    def __init__(
        self,
        publisher: Publisher,
        *,
        node_id: str,
        hostname: str,
        interval_s: float,
        reader: NvmlReader | None = None,
    ) -> None:
        self.publisher = publisher
        self.node_id = node_id
        self.hostname = hostname
        self.interval_s = interval_s
        self.reader = reader or NvmlReader()
        self.published = 0
        """Readings published since the start."""
        self._problem: str | None = None

    def _report(self, problem: str | None) -> None:
        """Log a problem when it first appears (or changes), and its end once."""
        if problem == self._problem:
            return
        if problem is not None:
            logger.warning("telemetry: %s", problem)
        elif self._problem is not None:
            logger.info("telemetry: publishing GPU readings of node %s again", self.node_id)
        self._problem = problem

    def _read(self) -> NodeTelemetry:
        self.reader.open()
        try:
            return self.reader.read(node_id=self.node_id, hostname=self.hostname, interval_s=self.interval_s)
        except TelemetryError:
            self.reader.close()  # start NVML afresh at the next interval (a GPU lost, a driver reloaded)
            raise

    async def tick(self) -> NodeTelemetry | None:
        """Read the GPUs once and publish the reading.

        Returns:
            The reading published, or None when there was none (no NVML, a failed reading or publish).
        """
        try:
            reading = await asyncio.to_thread(self._read)
        except NvmlUnavailable as exc:
            self._report(f"{exc.message} Publishing nothing; NVML is tried again every {self.interval_s:g} s.")
            await self.publisher.withdraw(exc.message)
            return None
        except TelemetryError as exc:
            self._report(exc.message)
            await self.publisher.withdraw(exc.message)
            return None
        try:
            await self.publisher.publish(reading)
        except RegistryUnavailable as exc:
            self._report(f"the reading could not be published: {exc.message}")
            return None
        self._report(None)
        if self.published == 0:
            logger.info("telemetry: publishing %d GPU(s) of node %s", len(reading.gpus), self.node_id)
        self.published += 1
        return reading

    async def run(self, stop: asyncio.Event) -> None:
        """Publish a reading every interval until `stop` is set, then withdraw and close.

        Readings are due on a fixed schedule (not `interval_s` after the end of the last one), so the time a
        reading takes does not stretch the interval.

        Raises:
            ConfigError: the publisher cannot start (the endpoint's address is taken, no token).
        """
        await self.publisher.start()
        try:
            due = time.monotonic()
            while not stop.is_set():
                await self.tick()
                due += self.interval_s
                if due < time.monotonic():  # a reading took longer than an interval: skip the missed ones
                    due = time.monotonic() + self.interval_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=due - time.monotonic())
        finally:
            await asyncio.to_thread(self.reader.close)
            await self.publisher.aclose()
