import pytest

from hydrad.bench import SLO, BenchConfig, GoodputSearch, Sampling, sweep_rates
from hydrad.errors import ConfigError

URL = "http://127.0.0.1:8000"
SLO_ = SLO(ttft=1.0, tbt=0.1)


def test_sweep_rates_include_both_ends():
    assert sweep_rates(1, 2, 0.25) == (1.0, 1.25, 1.5, 1.75, 2.0)
    assert sweep_rates(0.1, 0.3, 0.1) == (0.1, 0.2, 0.3)  # no float drift drops the last rate


@pytest.mark.parametrize("args", [(0, 2, 1), (3, 2, 1), (1, 2, 0)])
def test_bad_sweeps(args):
    with pytest.raises(ConfigError):
        sweep_rates(*args)


@pytest.mark.parametrize(
    "overrides",
    [
        {"url": "127.0.0.1:8000"},
        {"num_requests": 10, "duration": 5.0},
        {"num_requests": 0},
        {"rates": ()},
        {"search": GoodputSearch()},
        {"rates": (0.0,)},
        {"arrivals": "uniform"},
        {"trace": "t.jsonl"},
        {"instances": 0},
        {"image_format": "gif"},
        {"concurrency": 4},
        {"rates": (), "concurrency": 0},
        {"warmup": -1},
        {"rates": (), "concurrency": 2, "warmup": -1},
        {"rates": (), "concurrency": 2, "trace": "t.jsonl", "arrivals": "trace"},
    ],
)
def test_invalid_configs_raise_value_errors(overrides):
    with pytest.raises(ValueError):
        BenchConfig(**{"url": URL, "slo": SLO_, "rates": (1.0,), **overrides})


@pytest.mark.parametrize("kwargs", [{"ttft": 0, "tbt": 1}, {"ttft": 1, "tbt": -1}])
def test_slo_must_be_positive(kwargs):
    with pytest.raises(ValueError):
        SLO(**kwargs)


def test_goodput_search_bounds():
    search = GoodputSearch(start_rate=4.0)
    assert (search.lower, search.upper) == (0.25, 1024.0)
    with pytest.raises(ValueError):
        GoodputSearch(start_rate=4.0, max_rate=2.0)
    with pytest.raises(ValueError):
        GoodputSearch(rel_tol=0)


@pytest.mark.parametrize("url", [URL, URL + "/", URL + "/v1", URL + "/v1/"])
def test_base_url_accepts_the_v1_suffix(url):
    assert BenchConfig(url=url, slo=SLO_, rates=(1.0,)).base_url == URL


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"temperature": 2.5}, {"top_p": 0.0}, {"top_p": 1.5},
                                    {"top_k": 0}])
def test_bad_sampling_is_refused(kwargs):
    with pytest.raises(ValueError):
        Sampling(**kwargs)


def test_sampling_fields_name_only_what_is_set():
    assert Sampling().fields() == {"temperature": 0.0}
    assert Sampling(0.8, 0.9, 50).fields() == {"temperature": 0.8, "top_p": 0.9, "top_k": 50}


def test_a_response_format_goes_in_every_request(tmp_path):
    from hydrad.bench.config import response_format_of

    assert Sampling(response_format=response_format_of("json_object")).fields() == {
        "temperature": 0.0, "response_format": {"type": "json_object"}}
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    body = Sampling(1.0, response_format=response_format_of(f"json_schema:{schema}")).fields()["response_format"]
    assert body == {"type": "json_schema", "json_schema": {"name": "bench", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}
    for spec, message in (("xml", "json_object or json_schema:FILE"), (f"json_schema:{tmp_path}/none.json",
                                                                      "cannot read a JSON schema"),
                          ("json_schema:", "json_object or json_schema:FILE")):
        with pytest.raises(ConfigError, match=message):
            response_format_of(spec)
    schema.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds no JSON schema object"):
        response_format_of(f"json_schema:{schema}")
