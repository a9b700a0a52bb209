"""A worker on the driver's node exits within a fraction of a second of the driver's death, even while it is busy
(`controller.host.watch_driver`): Ray starts workers in process groups of their own, so a killed driver's group
does not take them, and one in the middle of a checkpoint write would otherwise finish it."""

import os
import subprocess
import sys
import time

from shardrl.controller.host import DRIVER_CHECK_S, Driver, _start_time

BUSY_WORKER = """
import time
from shardrl.controller.host import Driver, watch_driver
watch_driver(Driver("node", {pid}, {started!r}))
print("watching", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # busy, as a worker writing a checkpoint is
    sum(range(10000))
"""


def test_a_worker_exits_soon_after_its_driver_dies():
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = _start_time(driver.pid)
    worker = subprocess.Popen([sys.executable, "-c", BUSY_WORKER.format(pid=driver.pid, started=started)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "watching"
        time.sleep(3 * DRIVER_CHECK_S)
        assert worker.poll() is None  # the driver lives: the worker goes on
        driver.kill()
        driver.wait()
        killed_at = time.monotonic()
        worker.wait(timeout=10)
        assert time.monotonic() - killed_at < 1.5
        assert worker.returncode == 1
        assert f"the driver (pid {driver.pid}) is gone" in worker.stderr.read()
    finally:
        for proc in (driver, worker):
            if proc.poll() is None:
                proc.kill()


def test_a_new_process_under_the_drivers_pid_is_not_the_driver():
    me = os.getpid()
    assert Driver("node", me, _start_time(me)).alive()
    assert not Driver("node", me, "0").alive()  # the pid, another start time: a recycled pid
    assert not Driver("node", 2**22 + 12345, None).alive()  # no such process
