import psycopg


def test_each_test_gets_a_migrated_database(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    row = conn.execute("SELECT count(*) FROM pgqueue_jobs").fetchone()
    assert row == (0,)
