# MLflow tracking server with the Postgres driver, the S3 client and basic auth.
FROM python:3.11-slim
RUN pip install --no-cache-dir "mlflow[auth]==3.17.2" psycopg2-binary==2.9.13 boto3==1.44.8
COPY mlflow-auth.ini /etc/mlflow/basic_auth.ini
ENV MLFLOW_AUTH_CONFIG_PATH=/etc/mlflow/basic_auth.ini
EXPOSE 5000
