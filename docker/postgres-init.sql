-- Runs once, when the data volume is created: POSTGRES_DB is Airflow's metadata DB,
-- and MLflow's backend store gets a database of its own beside it.
CREATE DATABASE mlflow;
