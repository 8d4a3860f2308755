"""SQL console: one read-only statement at a time, result as a table with a CSV download."""

import streamlit as st

from rankscope.dashboard import queries, ui
from rankscope.storage.store import StoreError


def load_example() -> None:
    name = st.session_state.get("sql_example")
    if name:
        st.session_state["sql_text"] = queries.SQL_EXAMPLES[name].format(db=st.session_state.get("_sql_db", "rankscope"))


def run(store, sql: str) -> None:
    st.session_state.pop("sql_result", None)
    st.session_state.pop("sql_error", None)
    try:
        st.session_state["sql_result"] = queries.run_readonly(store, sql)
    except queries.SqlRefused as e:
        st.session_state["sql_error"] = ("Refused", str(e))
    except StoreError as e:
        st.session_state["sql_error"] = ("ClickHouse said", str(e))


def show_result() -> None:
    if "sql_error" in st.session_state:
        title, msg = st.session_state["sql_error"]
        st.error(f"**{title}:** {msg}", icon="🚫")
        return
    res: queries.SqlResult | None = st.session_state.get("sql_result")
    if res is None:
        return
    n = len(res.frame)
    st.caption(f"{n:,} row{'s' if n != 1 else ''} in {res.elapsed_s:.3f} s")
    if res.truncated:
        st.warning(f"Only the first {queries.CONSOLE_MAX_ROWS:,} rows are shown; add a LIMIT or aggregate.")
    st.dataframe(res.frame, hide_index=True)
    st.download_button("Download CSV", data=res.frame.to_csv(index=False).encode(), file_name="rankscope-query.csv",
                       mime="text/csv", icon=":material/download:", on_click="ignore")


st.title("SQL console")
cfg = ui.connect()
store = ui.store_or_warn(cfg) if cfg is not None else None
if store is not None:
    st.session_state["_sql_db"] = store.database
    st.caption(f"Read-only: one `SELECT`, `WITH`, `SHOW`, `DESCRIBE` or `EXPLAIN` statement, run with "
               f"`readonly=1`, at most {queries.CONSOLE_MAX_ROWS:,} rows and {queries.CONSOLE_TIMEOUT_S:g} s. "
               f"Tables live in database `{store.database}` (unqualified names work too).")
    st.selectbox("Examples", list(queries.SQL_EXAMPLES), index=None, placeholder="Load a saved query…", key="sql_example",
                 on_change=load_example)
    st.session_state.setdefault("sql_text", queries.SQL_EXAMPLES[next(iter(queries.SQL_EXAMPLES))].format(db=store.database))
    sql = st.text_area("Query", key="sql_text", height=200)
    if st.button("Run", type="primary", icon=":material/play_arrow:"):
        run(store, sql)
    show_result()
    with st.expander("Tables and columns"):
        try:
            cols = queries.table_columns(store)
        except StoreError as e:
            st.warning(f"The store did not answer: {e}")
        else:
            for table, part in cols.groupby("table", sort=True):
                st.markdown(f"**{table}** · " + ", ".join(f"`{n}` {t}" for n, t in zip(part["name"], part["type"],
                                                                                          strict=True)))
