"""Worker CPU and memory as the daemon reads them from /proc."""

import os
import time

import pytest

from hydrad.cluster.usage import UsageWindow, read_usage

TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")


def write_stat(proc, pid: int, command: str, utime: int, stime: int, rss_pages: int, shmem_kb: int | None = None):
    # proc(5)'s fields after the command: state, ppid, ..., utime (14), stime (15), ..., rss (24).
    rest = ["S", "1", "1", "1", "0", "-1", "0", "0", "0", "0", "0", str(utime), str(stime), "0", "0", "20", "0",
            "1", "0", "100", "123456789", str(rss_pages), "0"]
    (proc / str(pid)).mkdir(exist_ok=True)
    (proc / str(pid) / "stat").write_text(f"{pid} ({command}) " + " ".join(rest) + "\n")
    if shmem_kb is not None:
        (proc / str(pid) / "status").write_text(f"Name:\tw\nVmRSS:\t{rss_pages * PAGE // 1024} kB\n"
                                                f"RssAnon:\t  12 kB\nRssShmem:\t    {shmem_kb} kB\nThreads:\t2\n")


def test_own_process_matches_what_the_kernel_says_elsewhere():
    end = time.process_time() + 0.2
    while time.process_time() < end:  # some CPU to count
        pass
    usage = read_usage(os.getpid())
    assert abs(usage.cpu_seconds - time.process_time()) < 2 / TICKS + 0.05
    status = {line.split(":")[0]: int(line.split()[1]) for line in open("/proc/self/status")
              if line.startswith(("VmRSS:", "RssShmem:"))}
    assert abs(usage.rss_bytes - status["VmRSS"] * 1024) < 64 << 20
    assert usage.shared_bytes == status["RssShmem"] * 1024 <= usage.rss_bytes + (64 << 20)


def test_shared_memory_the_process_maps_counts_as_shared():
    """Pages of a /dev/shm file this process touched: resident, and shared."""
    import mmap

    before = read_usage(os.getpid()).shared_bytes
    with open(f"/dev/shm/hydrad-test-usage-{os.getpid()}", "w+b") as f:
        try:
            f.truncate(32 << 20)
            with mmap.mmap(f.fileno(), 32 << 20) as m:
                for offset in range(0, 32 << 20, PAGE):
                    m[offset] = 1
                after = read_usage(os.getpid()).shared_bytes
        finally:
            os.unlink(f.name)
    assert after - before >= 30 << 20


def test_a_command_with_spaces_and_parentheses_is_skipped_whole(tmp_path):
    write_stat(tmp_path, 42, "hydrad: worker (0) EP", utime=3 * TICKS, stime=TICKS, rss_pages=1000, shmem_kb=256)
    usage = read_usage(42, proc=str(tmp_path))
    assert usage.cpu_seconds == pytest.approx(4.0) and usage.rss_bytes == 1000 * PAGE
    assert usage.shared_bytes == 256 * 1024
    write_stat(tmp_path, 42, "w", utime=0, stime=0, rss_pages=1)
    (tmp_path / "42" / "status").unlink()  # no status file: the rest still read
    assert read_usage(42, proc=str(tmp_path)).shared_bytes is None


def test_a_process_that_is_gone_reads_as_none(tmp_path):
    assert read_usage(43, proc=str(tmp_path)) is None
    (tmp_path / "44").mkdir()
    (tmp_path / "44" / "stat").write_text("44 (cut")  # a truncated line: nothing made up
    assert read_usage(44, proc=str(tmp_path)) is None


def test_share_of_a_core_over_the_window_and_processes_forgotten(tmp_path):
    window = UsageWindow(window=10.0, proc=str(tmp_path))
    write_stat(tmp_path, 7, "w", utime=0, stime=0, rss_pages=10)
    write_stat(tmp_path, 8, "w", utime=0, stime=0, rss_pages=20)
    window.sample([7, 8], now=100.0)
    assert window.cpu_share(7) is None and window.latest(8).rss_bytes == 20 * PAGE
    # 7 ran 1.5 s of CPU in 2 s, 8 none
    write_stat(tmp_path, 7, "w", utime=TICKS, stime=TICKS // 2, rss_pages=30)
    window.sample([7, 8], now=102.0)
    assert window.cpu_share(7) == pytest.approx(0.75) and window.cpu_share(8) == 0.0
    assert window.latest(7).rss_bytes == 30 * PAGE
    # samples older than the window go (the last one before it stays, so the span covers it)
    write_stat(tmp_path, 7, "w", utime=3 * TICKS, stime=TICKS // 2, rss_pages=30)
    window.sample([7, 8], now=112.0)
    write_stat(tmp_path, 7, "w", utime=5 * TICKS, stime=TICKS // 2, rss_pages=30)
    window.sample([7, 8], now=113.0)
    assert window.cpu_share(7) == pytest.approx((5.5 - 1.5) / (113.0 - 102.0))
    # a worker restarted under another pid: the old one is forgotten, the new one starts its window
    write_stat(tmp_path, 9, "w", utime=0, stime=0, rss_pages=5)
    window.sample([7, 9], now=114.0)
    assert window.latest(8) is None and window.cpu_share(8) is None
    assert window.latest(9).rss_bytes == 5 * PAGE and window.cpu_share(9) is None
    # a process that exits between two samples
    (tmp_path / "9" / "stat").unlink()
    window.sample([7, 9], now=115.0)
    assert window.latest(9) is None
