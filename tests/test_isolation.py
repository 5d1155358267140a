"""Per-user prefix-cache isolation: one member of the household cannot learn from
time-to-first-token whether another sent a given prompt; within one user (or with the
explicit opt-in) the cache still works. The real embedded model on loopback."""
import pytest

from edgepaged.client import ServerError, open_client
from edgepaged.request.frontend import cache_salt, load_users

from test_server import serving

# a long prompt, so a prefix-cache hit is plainly visible in the time to first token
LETTER = ("Dear neighbours, the garden party moves to Sunday because of the rain. " * 40).strip()


async def ttft_and_cached(server, token, **params):
    async with open_client(server.address, token=token) as c:
        _, done = await c.generate(LETTER, max_tokens=1, **params).collect()
    return done["timings"]["ttft_s"], done["usage"]["cached_tokens"]


async def test_prefix_cache_is_per_user_unless_shared(embedded_runner, tmp_path):
    users = tmp_path / "users"
    users.write_text("# name token\nanna tok-anna\njonas tok-jonas\n")
    async with serving(embedded_runner, users=load_users(users)) as server:
        cold, cached = await ttft_and_cached(server, "tok-anna")
        assert cached == 0
        warm, cached = await ttft_and_cached(server, "tok-anna")
        assert cached > 500, "the same user's repeat hits the cache"
        other, other_cached = await ttft_and_cached(server, "tok-jonas")
        assert other_cached == 0, "another user's identical prompt must not hit anna's cache"
        # the timing difference is there within one user and gone across users
        assert warm < cold / 2, (warm, cold)
        assert other > 2 * warm, (other, warm)
        # explicit opt-in: a household-wide cache
        await ttft_and_cached(server, "tok-anna", share_prefix_cache=True)
        _, shared_cached = await ttft_and_cached(server, "tok-jonas", share_prefix_cache=True)
        assert shared_cached > 500
        with pytest.raises(ServerError) as e:
            async with open_client(server.address, token="tok-nobody"):
                pass
        assert e.value.code == "auth_failed"


async def test_without_users_the_client_name_separates_caches(embedded_runner):
    async with serving(embedded_runner) as server:
        async with open_client(server.address, name="kitchen") as c:
            await c.generate(LETTER, max_tokens=1).collect()
            _, done = await c.generate(LETTER, max_tokens=1).collect()
            assert done["usage"]["cached_tokens"] > 500
        async with open_client(server.address, name="bedroom") as c:
            _, done = await c.generate(LETTER, max_tokens=1).collect()
            assert done["usage"]["cached_tokens"] == 0


def test_salts_and_users_file(tmp_path):
    assert cache_salt("anna") == cache_salt("anna") != cache_salt("jonas")
    assert cache_salt("anna", shared=True) == 0 and cache_salt("anna") > 0
    bad = tmp_path / "bad"
    bad.write_text("anna t1\njonas t1\n")
    with pytest.raises(ValueError, match="already used"):
        load_users(bad)
    bad.write_text("only-a-name\n")
    with pytest.raises(ValueError, match="expected"):
        load_users(bad)
