"""Parsers against outputs copied exactly from real tools (tests/fixtures/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from monitoring.parse import (
    accounting_gpu_tres,
    expand_hostlist,
    expand_indices,
    gpus_in_tres,
    is_fault,
    looks_like_table,
    parse_bsc_load,
    parse_bytes,
    parse_compute_apps,
    parse_duration,
    parse_number,
    parse_nvidia_smi_table,
    parse_probe_output,
    parse_query_gpu,
    parse_sacct,
    parse_sample_csv,
    parse_scontrol_job,
    parse_tres,
    read_query_gpu,
)

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_bsc_load_box_table_from_seed() -> None:
    (node,) = parse_bsc_load(fixture("bsc_load_mn5_4xH100.txt"))
    assert node.node == "as07r3b28"
    assert node.ncpus == 80
    assert node.cpu_usage_pct == pytest.approx(7.938)
    assert node.power_w is None  # "N/A": missing, not 0
    assert [g.index for g in node.gpus] == [0, 1, 2, 3]
    assert [g.utilization_pct for g in node.gpus] == [56.0, 99.0, 100.0, 74.0]
    assert [g.memory_pct for g in node.gpus] == pytest.approx([78.168, 78.327, 78.591, 76.071])


def test_bsc_load_tab_separated_ansi_variant() -> None:
    # The other layout seen in public scripts (no exact copy available): ANSI colours, tabs,
    # preamble lines and a separator. Built here from the seed's values.
    seed = parse_bsc_load(fixture("bsc_load_mn5_4xH100.txt"))[0]
    header = "NODE\tNCPUs\tCPU_USAGE (%)\tPOWER (W)\tGPU0 (%)\tMEM0 (%)\tGPU1\tMEM1"
    text = "\n".join(
        [
            "\x1b[1mJob 123\x1b[0m",
            "user: someone",
            "",
            header,
            "----\t----\t----\t----\t----\t----\t----\t----",
            "\x1b[32mas07r3b28\x1b[0m\t80\t7.938\t812.5\t56.000\t78.168\tN/A\t78.327",
        ]
    )
    (node,) = parse_bsc_load(text)
    assert node.node == seed.node
    assert node.power_w == 812.5
    assert [g.utilization_pct for g in node.gpus] == [56.0, None]


def test_nvidia_smi_table_from_seed() -> None:
    probe = parse_nvidia_smi_table(fixture("nvidia_smi_table_mn5_4xH100.txt"), "node1")
    by_index = {s.index: s for s in probe.samples}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert [by_index[i].utilization_gpu for i in range(4)] == [100.0, 49.0, 95.0, 38.0]
    assert by_index[0].name == "NVIDIA H100"
    assert by_index[0].memory_used_mib == 45934.0
    assert by_index[3].memory_total_mib == 65247.0
    assert by_index[1].power_w == 272.0
    assert by_index[3].temperature_c == 44.0
    assert [(p.gpu_index, p.pid, p.used_memory_mib) for p in probe.processes] == [
        (0, 384631, 43476.0),
        (1, 384632, 42376.0),
        (2, 384633, 44096.0),
        (3, 384634, 39176.0),
    ]
    assert probe.errors == ()


def test_query_gpu_csv_with_header_and_units() -> None:
    samples, errors = parse_query_gpu(fixture("nvidia_smi_query_gpu_8xH200.csv"), "h200")
    assert errors == []
    assert [s.index for s in samples] == list(range(8))
    assert [s.utilization_gpu for s in samples] == [100.0] * 7 + [0.0]
    assert samples[7].uuid == "GPU-28780eb0-24d5-1f13-59b8-ae5c23617a72"
    assert samples[2].memory_used_mib == 105851.0
    assert samples[0].memory_total_mib == 143771.0
    # Not queried in that recording: unknown, not zero.
    assert samples[0].power_w is None and samples[0].name is None


def test_query_gpu_l40s_columns_come_from_the_header() -> None:
    (sample,), errors = parse_query_gpu(fixture("nvidia_smi_query_gpu_1xL40S.csv"), "l40s")
    assert errors == []
    assert (sample.index, sample.name) == (0, "NVIDIA L40S")
    assert (sample.memory_used_mib, sample.memory_total_mib) == (9123.0, 46068.0)
    assert sample.utilization_gpu is None


def test_compute_apps_with_not_found_name() -> None:
    processes, errors = parse_compute_apps(fixture("nvidia_smi_compute_apps_8xH200.csv"), "h200")
    assert errors == []
    assert len(processes) == 8
    assert processes[0].pid == 1328667
    assert processes[0].process_name == "/usr/local/bin/python3.10"
    assert processes[7].process_name is None  # "[Not Found]"
    assert processes[7].used_memory_mib == 58060.0
    l40s, _ = parse_compute_apps(fixture("nvidia_smi_compute_apps_1xL40S.csv"), "l40s")
    assert [p.process_name for p in l40s][1].endswith("triton_python_backend_stub")


def test_missing_values_are_none_and_lost_gpu_is_an_error() -> None:
    lines = fixture("nvidia_smi_missing_and_errors.txt").splitlines()
    cells = [c.strip() for c in lines[0].split(",")]
    assert [parse_number(c) for c in cells[2:]] == [None, None, 24576.0, 8192.0, None, None, None]
    assert [parse_number(c) for c in lines[1].split(",")] == [55.0, None, None, 1024.0, 12282.0]
    samples, errors = parse_query_gpu(lines[2], "gpu-node")
    assert samples == []
    assert errors[0].host == "gpu-node"
    assert "fallen off the bus" in errors[0].message


def test_query_gpu_keeps_good_gpus_next_to_a_lost_one() -> None:
    good = "0, GPU-1, NVIDIA H100, 97, 40, 30000, 81559, 350.1, 60"
    lost = fixture("nvidia_smi_missing_and_errors.txt").splitlines()[2]
    samples, errors = parse_query_gpu(f"{good}\n{lost}\n", "n1")
    assert [(s.index, s.utilization_gpu, s.power_w) for s in samples] == [(0, 97.0, 350.1)]
    assert [e.message for e in errors] == [lost]


@pytest.mark.parametrize(
    ("fixture_name", "ave_or_max"),
    [("sacct_gpu_tres_max_curc.txt", "max"), ("sacct_gpu_tres_ave_noconvert_curc.txt", "ave")],
)
def test_sacct_gpu_tres(fixture_name: str, ave_or_max: str) -> None:
    column = "TRESUsageInMax" if ave_or_max == "max" else "TRESUsageInAve"
    rows = parse_sacct(fixture(fixture_name), ["JobID", column])
    assert [r["JobID"] for r in rows] == ["18194943", "18194943.batch", "18194943.extern"]
    batch, extern = accounting_gpu_tres(rows)
    assert batch.step == "18194943.batch"
    util = batch.gpuutil_max if ave_or_max == "max" else batch.gpuutil_ave
    mem = batch.gpumem_max_bytes if ave_or_max == "max" else batch.gpumem_ave_bytes
    assert util == 100.0
    expected_mem = 38888 * 2**20 if ave_or_max == "max" else 40777023488
    assert mem == expected_mem
    assert (extern.gpuutil_ave or 0.0) + (extern.gpuutil_max or 0.0) == 0.0


def test_slurm_helpers() -> None:
    assert expand_hostlist("node[01-03,07],gpu5") == [
        "node01",
        "node02",
        "node03",
        "node07",
        "gpu5",
    ]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert expand_hostlist("(null)") == []
    assert expand_indices("0-1,3") == (0, 1, 3)
    assert parse_duration("1-02:03:04") == 93784
    assert parse_duration("03:04") == 184
    assert parse_duration("UNLIMITED") is None
    tres = parse_tres("billing=1,cpu=1,gres/gpu=1,gres/gpumem=4G,gres/gpuutil=100,mem=4G")
    assert gpus_in_tres(tres) == 1
    assert gpus_in_tres(parse_tres("cpu=8,gres/gpu:a100=2,gres/gpu:v100=2")) == 4
    assert gpus_in_tres(parse_tres("cpu=8,mem=4G")) is None
    assert parse_bytes("4G") == 4 * 2**30 and parse_bytes("12") == 12 and parse_bytes("x") is None


def test_sample_csv_and_probe_output_round_trip() -> None:
    csv = (
        "time,host,job_id,index,uuid,name,utilization.gpu,utilization.memory,memory.used,"
        "memory.total,power.draw,temperature.gpu\n"
        "100.0,n1,42,0,GPU-1,NVIDIA H100,[N/A],3,100,81559,[Not Supported],50\n"
        "garbage\n"
        "101.0,n1,42,0,GPU-1,NVI"  # cut off: the sampler was killed mid-write
    )
    samples, errors = parse_sample_csv(csv, "n1")
    assert [(s.time, s.job_id, s.utilization_gpu, s.power_w) for s in samples] == [
        (100.0, "42", None, None)
    ]
    assert [e.message for e in errors] == ["unreadable sample row: garbage"]
    probe = parse_probe_output(
        '0: {"host": "n1", "kind": "gpu", "time": 5.0, "returncode": 0,'
        ' "lines": ["0, GPU-1, NVIDIA H100, 97, 40, 30000, 81559, 350.1, 60"]}\n'
        '1: {"host": "n2", "kind": "missing", "message": "nvidia-smi not found on PATH"}\n'
        "srun: error: something odd\n"
    )
    assert [(s.host, s.utilization_gpu, s.time) for s in probe.samples] == [("n1", 97.0, 5.0)]
    assert [e.host for e in probe.errors] == ["n2", "?"]
    assert probe.hosts == ("n1", "n2")


def test_scontrol_job_on_slurm_22_05() -> None:
    # 22.05 without gres/gpu in AccountingStorageTRES: TRES has no GPUs, the -d details do.
    job = parse_scontrol_job(fixture("scontrol_show_job_running_2gpu.txt"))
    assert (job.job_id, job.state, job.user, job.name) == ("4", "RUNNING", "root", "wrap")
    assert job.nodes == ("vm",)
    assert job.gpus == 2 and job.gpu_indices == {"vm": (0, 1)}
    assert job.run_seconds is not None and job.run_seconds > 0
    assert (job.work_dir, job.stdout) == ("/tmp", "/tmp/slurm-4.out")
    assert job.is_running and not job.is_pending


# A unified-memory GPU's table rows, in the shape NVIDIA's DGX Spark (GB10) prints them: the
# memory cell reads `Not Supported` (docs.nvidia.com/dgx/dgx-spark/known-issues.html, "nvidia-smi
# reports memory usage: Not Supported"; the same rows are quoted in public issue threads). Built
# here, not recorded: we have no GB10; the readings (51C, 24W, 87%) are ours.
GB10_TABLE = """\
+-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|=========================================+========================+======================|
|   0  NVIDIA GB10                    On  |   0000000F:01:00.0 Off |                  N/A |
| N/A   51C    P0             24W /  N/A  | Not Supported          |     87%      Default |
|                                         |                        |                  N/A |
+-----------------------------------------+------------------------+----------------------+
"""


def test_unified_memory_gpu_is_kept_with_its_memory_missing() -> None:
    probe = parse_nvidia_smi_table(GB10_TABLE, "spark")
    (gpu,) = probe.samples
    assert (gpu.index, gpu.name, gpu.utilization_gpu) == (0, "NVIDIA GB10", 87.0)
    assert (gpu.power_w, gpu.temperature_c) == (24.0, 51.0)
    assert gpu.memory_used_mib is None and gpu.memory_total_mib is None
    assert gpu.faults == ()  # not supported is not a fault
    assert looks_like_table(GB10_TABLE)  # a fragment without the NVIDIA-SMI banner


def _with_err(table: str, gpu_line: int, old: str, new: str) -> str:
    """The seed's 4 x H100 table with one cell replaced (same width): what nvidia-smi prints
    for a GPU in an error state (`ERR!`, e.g. after a GSP timeout), built from the recording."""
    lines = table.splitlines()
    assert old in lines[gpu_line] and len(old) == len(new)
    lines[gpu_line] = lines[gpu_line].replace(old, new, 1)
    return "\n".join(lines) + "\n"


def test_err_cells_are_faults_not_missing_values() -> None:
    table = fixture("nvidia_smi_table_mn5_4xH100.txt")
    second_gpu = next(i for i, line in enumerate(table.splitlines()) if "|   1  " in line) + 1
    broken = _with_err(table, second_gpu, "  49%", " ERR!")  # GPU 1 read 49% in the seed
    samples = parse_nvidia_smi_table(broken, "as01").samples
    assert [s.index for s in samples] == [0, 1, 2, 3]  # the faulted GPU is not dropped
    assert samples[1].utilization_gpu is None
    assert samples[1].faults == ("utilization.gpu: ERR!",)
    assert [s.faults for s in samples if s.index != 1] == [(), (), ()]
    # ERR! touching the border, in the fan column (a GPU that still computes): a fault too.
    fan = _with_err(table, second_gpu, table.splitlines()[second_gpu][:5], "|ERR!")
    assert parse_nvidia_smi_table(fan, "as01").samples[1].faults == ("fan: ERR!",)
    # --query-gpu CSV: NVML errors come bracketed; [N/A] / [Not Supported] stay plain missing.
    good = "0, GPU-1, NVIDIA H100, 97, 40, 30000, 81559, 350.1, 60"
    bad = "1, GPU-2, NVIDIA H100, [Unknown Error], 40, 30000, 81559, [GPU is lost], 60"
    samples, errors = parse_query_gpu(f"{good}\n{bad}\n", "n1")
    assert errors == [] and [s.faults for s in samples] == [
        (),
        ("utilization.gpu: [Unknown Error]", "power.draw: [GPU is lost]"),
    ]
    assert not any(is_fault(c) for c in ("[N/A]", "[Not Supported]", "N/A", "0", "ERR"))


def test_query_gpu_fields_come_from_a_pasted_command_line() -> None:
    # samples.md's L40S runbook, both commands and their outputs exactly as pasted.
    session = fixture("nvidia_smi_query_session_1xL40S.txt")
    read = read_query_gpu(session, "l40s")
    # One GPU: the processes below the second command are not GPUs.
    assert [(s.index, s.name, s.memory_used_mib) for s in read.samples] == [
        (0, "NVIDIA L40S", 9123.0)
    ]
    assert read.errors == [] and read.columns_from == "header"
    # The same output saved with --format=csv,noheader (built from the recording: the command
    # line says noheader, the header line is gone): the command line gives the fields.
    lines = session.splitlines()
    noheader = [lines[0].replace("--format=csv", "--format=csv,noheader"), lines[2]]
    read = read_query_gpu("\n".join(noheader), "l40s")
    assert read.columns_from == "command line"
    assert read.columns == ("index", "name", "memory.total", "memory.used", "memory.free")
    assert [(s.index, s.memory_total_mib, s.memory_used_mib) for s in read.samples] == [
        (0, 46068.0, 9123.0)
    ]
    # Rows alone: our own field order is assumed, and said to be.
    read = read_query_gpu(lines[2], "l40s")
    assert read.columns_from == "assumed" and read.samples == []
    assert read.errors[0].message == lines[2]
